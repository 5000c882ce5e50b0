"""The fp8 level's numerics on the CPU: error against fp32 per zoo model, for bf16 O1 and each fp8 recipe.

    bf16 O1           convert(model, "O1", dtype=torch.bfloat16)
    fp8 current       convert(model, "fp8", fp8_min_dim=16)        (the zoo's small matmuls qualify)
    fp8 current m2    ... fp8_margin=2: 2 bits of headroom, 2 fewer of range
    fp8 delayed       ... fp8_scaling="delayed" (amax history of 16 calls, its max; in eval mode nothing is
                      recorded, so its one-batch columns are current scaling's: the training column differs)
    fp8 rowwise       ... fp8_scaling="rowwise"

Per row: matmuls run in fp8 / left bf16 by lower_fp8_matmuls, the output's max error relative to the fp32
output's largest magnitude and its relative (Frobenius) error, the relative error of all parameter gradients
of the task's loss (one batch, eval mode so dropout does not differ), and the loss itself against fp32's.
Then training: the mean loss of the last 10 of --steps Adam steps (lr 1e-3, a fresh model of the same seed,
the same batches and dropout stream per recipe) and its gap to bf16 O1's, in loss and in % of bf16's (a loss
near 0, BERT's, makes the % large: read the difference there). tests/fp8/test_fp8_training.py asserts the 200-step
figures for GPT and BERT. On a busy machine run with OMP_NUM_THREADS=1: small models gain nothing from threads.
The CPU runs torch._scaled_mm correctly but slowly (oneDNN or an emulation): no speed here; speed needs an
fp8 GPU (H100/H200): benchmarks/gpu.py's fp8 section.

    python benchmarks/bench_fp8.py [--models mlp gpt] [--size small|full] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import models.torchvision_ops  # noqa: E402,F401  (torchvision's missing op schemas, before anything imports it)

import amp_compiler  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

RECIPES = {
    "bf16 O1": ("O1", {"dtype": torch.bfloat16}),
    "fp8 current": ("fp8", {"fp8_min_dim": 16}),
    "fp8 current m2": ("fp8", {"fp8_min_dim": 16, "fp8_margin": 2}),
    "fp8 delayed": ("fp8", {"fp8_min_dim": 16, "fp8_scaling": "delayed"}),
    "fp8 rowwise": ("fp8", {"fp8_min_dim": 16, "fp8_scaling": "rowwise"}),
}
SEED = 0
LEARNING_RATE = 1e-3


def run_once(module, task, inputs, target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, loss and every parameter gradient (flattened, in fp32) of one eval-mode forward and backward."""
    for p in task.model.parameters():
        p.grad = None
    output = module(*inputs)
    loss = task.loss_fn(output.float(), target)
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in task.model.parameters() if p.grad is not None])
    return output.detach().float(), loss.detach(), grads


def relative(error: torch.Tensor, reference: torch.Tensor) -> float:
    return (error.norm() / reference.norm().clamp(min=1e-30)).item()


def final_training_loss(name: str, size: str, level: str, options: dict, steps: int) -> float:
    """Mean loss of the last 10 of `steps` Adam steps of a fresh zoo model converted at `level`."""
    task = build(name, size=size, seed=SEED)
    torch.manual_seed(SEED)   # the dropout stream: the same for every recipe
    gm = amp_compiler.convert(task.model, level, example_inputs=task.example_inputs, **options).train()
    losses = task.train_losses(gm, steps, LEARNING_RATE)
    return sum(losses[-10:]) / len(losses[-10:])


def bench_model(name: str, size: str, steps: int) -> list[list]:
    task = build(name, size=size, seed=SEED)
    task.model.eval()
    inputs, target = task.make_batch(0)
    out32, loss32, grads32 = run_once(task.model, task, inputs, target)
    rows, trained_bf16 = [], None
    for recipe, (level, options) in RECIPES.items():
        gm = amp_compiler.convert(task.model, level, example_inputs=task.example_inputs, **options).eval()
        out, loss, grads = run_once(gm, task, inputs, target)
        fp8 = gm.meta["amp"]["pass_counts"].get("lower_fp8_matmuls", {})
        trained = final_training_loss(name, size, level, options, steps) if steps else None
        trained_bf16 = trained if level == "O1" else trained_bf16
        gap = "" if level == "O1" or trained is None else \
            f"{trained - trained_bf16:+.4f} ({100 * (trained - trained_bf16) / trained_bf16:+.1f}%)"
        rows.append([name, recipe, f"{fp8.get('fp8', 0)}/{fp8.get('kept', 0)}" if fp8 else "-",
                     f"{(out - out32).abs().max().item() / out32.abs().max().item():.2e}",
                     f"{relative(out - out32, out32):.2e}", f"{relative(grads - grads32, grads32):.2e}",
                     f"{loss.item():.4f} ({loss32.item():.4f})", "-" if trained is None else f"{trained:.4f}", gap])
    return rows


def table(header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO_NAMES), choices=ZOO_NAMES)
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--steps", type=int, default=30, help="training steps per recipe (0: no training column)")
    args = parser.parse_args()
    rows = [row for name in args.models for row in bench_model(name, args.size, args.steps)]
    print(f"fp8 numerics on the CPU, zoo size {args.size}, against fp32 (eval mode, one batch); training: mean "
          f"loss of the last 10 of {args.steps} Adam steps (lr {LEARNING_RATE}), gap against bf16 O1's")
    table(["model", "recipe", "fp8/kept matmuls", "out max err", "out rel err", "grad rel err", "loss (fp32)",
           f"loss @{args.steps}", "vs bf16"], rows)


if __name__ == "__main__":
    main()
