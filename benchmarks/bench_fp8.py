"""The fp8 level's numerics on the CPU: error against fp32 per zoo model, for bf16 O1 and fp8 recipes.

    bf16 O1          convert(model, "O1", dtype=torch.bfloat16)
    fp8 margin 0     convert(model, "fp8", fp8_min_dim=16)        (the zoo's small matmuls qualify)
    fp8 margin 2     convert(model, "fp8", fp8_min_dim=16, fp8_margin=2)   (2 bits of headroom, 2 fewer of range)

Per row: matmuls run in fp8 / left bf16 by lower_fp8_matmuls, the output's max error relative to the fp32
output's largest magnitude and its relative (Frobenius) error, the relative error of all parameter gradients
of the task's loss (one batch, eval mode so dropout does not differ), and the loss itself against fp32's.
The CPU runs torch._scaled_mm correctly but slowly (oneDNN or an emulation): no speed here; speed needs an
fp8 GPU (H100/H200), which benchmarks/gpu.py does not measure yet.

    python benchmarks/bench_fp8.py [--models mlp gpt] [--size small|full]
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
    "fp8 margin 0": ("fp8", {"fp8_min_dim": 16}),
    "fp8 margin 2": ("fp8", {"fp8_min_dim": 16, "fp8_margin": 2}),
}


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


def bench_model(name: str, size: str) -> list[list]:
    task = build(name, size=size)
    task.model.eval()
    inputs, target = task.make_batch(0)
    out32, loss32, grads32 = run_once(task.model, task, inputs, target)
    rows = []
    for recipe, (level, options) in RECIPES.items():
        gm = amp_compiler.convert(task.model, level, example_inputs=task.example_inputs, **options).eval()
        out, loss, grads = run_once(gm, task, inputs, target)
        fp8 = gm.meta["amp"]["pass_counts"].get("lower_fp8_matmuls", {})
        rows.append([name, recipe, f"{fp8.get('fp8', 0)}/{fp8.get('kept', 0)}" if fp8 else "-",
                     f"{(out - out32).abs().max().item() / out32.abs().max().item():.2e}",
                     f"{relative(out - out32, out32):.2e}", f"{relative(grads - grads32, grads32):.2e}",
                     f"{loss.item():.4f} ({loss32.item():.4f})"])
    return rows


def table(header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO_NAMES), choices=ZOO_NAMES)
    parser.add_argument("--size", default="small", choices=("small", "full"))
    args = parser.parse_args()
    rows = [row for name in args.models for row in bench_model(name, args.size)]
    print(f"fp8 numerics on the CPU, zoo size {args.size}, against fp32 (eval mode, one batch)")
    table(["model", "recipe", "fp8/kept matmuls", "out max err", "out rel err", "grad rel err", "loss (fp32)"], rows)


if __name__ == "__main__":
    main()
