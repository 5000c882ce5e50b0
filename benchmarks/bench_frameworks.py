"""Framework integrations: ms per training step of amp-compiler's plugin against the framework's own AMP, on CPU.

    python benchmarks/bench_frameworks.py [--models gpt,mlp] [--steps 20] [--warmup 5] [--rounds 2] [--clock cpu]

Lightning row(s): the same zoo model ("full" size) trained by Trainer.fit with SGD for warmup + steps steps,
timed per step by a callback (on_train_batch_start -> on_train_batch_end: forward, backward, optimizer step),
median over the timed steps of all rounds. Variants: precision="32-true", Lightning's precision="bf16-mixed"
(torch.autocast), and Trainer(plugins=[AmpPrecision("O1", dtype=torch.bfloat16)]) (the first steps capture
the graphs: they are in the warm-up). Rounds alternate the variants so machine load hits them alike.
`--clock cpu` times the process's CPU time (all threads) instead of wall time: steadier on a shared machine.
Prints a markdown table; other frameworks (HF Trainer, Accelerate) can add rows from their own files.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # models/ is not installed

import models.torchvision_ops  # noqa: E402,F401  (lightning imports torchmetrics, which imports torchvision)
import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

from amp_compiler.lightning import AmpPrecision  # noqa: E402
from models import build  # noqa: E402

VARIANTS = {
    "fp32 (32-true)": lambda: {"precision": "32-true"},
    "bf16-mixed (autocast)": lambda: {"precision": "bf16-mixed"},
    "AmpPrecision O1 bf16": lambda: {"plugins": [AmpPrecision("O1", dtype=torch.bfloat16)]},
}


class ZooModule(pl.LightningModule):
    """A zoo task's model trained on its own batches; training_step calls the model, not self.forward."""

    def __init__(self, name: str):
        super().__init__()
        self.task = build(name, size="full")
        self.model = self.task.model

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return self.task.loss_fn(self.model(*inputs), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class StepTimer(pl.Callback):
    def __init__(self, warmup: int, clock: str):
        self.warmup, self.clock, self.times = warmup, CLOCKS[clock], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.started = self.clock()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(self.clock() - self.started)


def lightning_step_times(name: str, settings: dict, steps: int, warmup: int, clock: str) -> list[float]:
    module = ZooModule(name)
    data = [module.task.make_batch(step) for step in range(warmup + steps)]
    timer = StepTimer(warmup, clock)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=warmup + steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer], **settings)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return timer.times


def lightning_rows(names: list[str], steps: int, warmup: int, rounds: int, clock: str) -> list[list[str]]:
    rows = []
    for name in names:
        times = {variant: [] for variant in VARIANTS}
        for _ in range(rounds):
            for variant, settings in VARIANTS.items():
                times[variant] += lightning_step_times(name, settings(), steps, warmup, clock)
        medians = {variant: 1000 * statistics.median(found) for variant, found in times.items()}
        ours, autocast = medians["AmpPrecision O1 bf16"], medians["bf16-mixed (autocast)"]
        rows.append(["Lightning Trainer", name, *(f"{medians[v]:.1f}" for v in VARIANTS), f"{autocast / ours:.2f}x"])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,mlp", help="zoo models, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (captures happen here)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every variant once")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: process CPU time")
    args = parser.parse_args()
    rows = lightning_rows(args.models.split(","), args.steps, args.warmup, args.rounds, args.clock)
    header = ["framework", "model (zoo, full)", *(f"{v} ms/step" for v in VARIANTS), "speed-up vs bf16-mixed"]
    print(f"ms per training step ({args.clock} clock), CPU, {torch.get_num_threads()} threads, median of {args.steps} x {args.rounds} "
          f"steps after {args.warmup} warm-up")
    print(markdown(header, rows))


if __name__ == "__main__":
    main()
