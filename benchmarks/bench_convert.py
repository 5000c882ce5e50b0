"""Benchmark the compiler core; prints three tables.

1. convert() time against graph size (deep MLPs of 250/500/1000 Linear+ReLU blocks).
2. Casts per forward (dtype-changing aten._to_copy calls, counted at runtime) against torch.autocast.
3. bf16 training step of the converted zoo models against torch.autocast on CPU, alternated in one run.

    python benchmarks/bench_convert.py [--repeats 20] [--size full]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import amp_compiler  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402


class CastCounter(TorchDispatchMode):
    """Dtype-changing casts at run time, and their bytes (the fp32 side of each: input or output)."""

    def __init__(self):
        super().__init__()
        self.casts, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and isinstance(out, torch.Tensor) \
                and isinstance(args[0], torch.Tensor) and args[0].dtype != out.dtype:
            self.casts += 1
            self.bytes += max(args[0].nbytes, out.nbytes)
        return out


def deep_mlp(blocks: int) -> nn.Module:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers)


def table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def convert_time():
    rows, previous = [], None
    for blocks in (250, 500, 1000):
        model = deep_mlp(blocks)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            gm = amp_compiler.convert(model, "O1")
            times.append(time.perf_counter() - start)
        best = min(times)
        growth = f"{best / previous:.2f}x" if previous else "-"
        previous = best
        rows.append([blocks, len(gm.graph.nodes), f"{best:.3f}", growth])
    table("convert() time, deep MLP (target: < 1 s at 1000 blocks, ~2x per doubling)",
          ["blocks", "fx nodes", "seconds", "vs half"], rows)


def casts_per_forward(size: str):
    """Counts casts over forward + loss, as a training step runs them: autocast leaves the logits in low
    precision and casts them for the loss; keep_io_types casts them back inside the graph instead."""
    rows = []
    for name in ZOO_NAMES:
        for dtype in (torch.float16, torch.bfloat16):
            task = build(name, size=size)
            inputs, target = task.make_batch(0)
            task.model.eval()
            counts = {}
            for level in ("O1", "O2"):
                gm = amp_compiler.convert(task.model, level, dtype=dtype, example_inputs=inputs)
                gm.eval()
                ours = CastCounter()
                with torch.no_grad(), ours:
                    task.loss_fn(gm(*inputs), target)
                fp32_ops = sum(1 for n in gm.graph.nodes if n.meta.get("amp", {}).get("precision") == "fp32")
                counts[level] = (ours.casts, fp32_ops)
            theirs = CastCounter()
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype), theirs:
                task.loss_fn(task.model(*inputs), target)
            rows.append([name, str(dtype).removeprefix("torch."), counts["O1"][0], counts["O2"][0], theirs.casts,
                         f"{counts['O1'][0] / max(theirs.casts, 1):.2f}",
                         f"{counts['O2'][0] / max(theirs.casts, 1):.2f}", counts["O1"][1]])
    table("casts per forward + loss (runtime _to_copy count; lower is better). CPU autocast runs softmax, "
          "layer/batch norm and scatter-adds in low precision; amp-compiler O1 keeps softmax, layer norm and "
          "scatter-adds fp32 and runs batch/group norms on low activations with fp32 weights",
          ["model", "dtype", "O1", "O2", "autocast", "O1/autocast", "O2/autocast", "fp32 ops at O1"], rows)


def train_step_time(size: str, repeats: int):
    rows = []
    for name in ZOO_NAMES:
        task = build(name, size=size)
        inputs, target = task.make_batch(0)
        model = task.model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)

        def ours():
            opt.zero_grad(set_to_none=True)
            task.loss_fn(gm(*inputs), target).backward()
            opt.step()

        def autocast():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = task.loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()

        for fn in (ours, autocast, ours, autocast):  # warm up
            fn()
        times = {"ours": [], "autocast": []}
        for _ in range(repeats):  # alternate so drift hits both equally
            for key, fn in (("ours", ours), ("autocast", autocast)):
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
        a, b = statistics.median(times["ours"]), statistics.median(times["autocast"])
        rows.append([name, f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"{a / b:.2f}"])
    table(f"bf16 training step, CPU, {size} zoo models, median of {repeats} alternated runs "
          "(target: ratio <= 1.0)", ["model", "amp-compiler ms", "autocast ms", "ratio"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--size", default="full", choices=("small", "full"))
    args = parser.parse_args()
    torch.manual_seed(0)
    convert_time()
    casts_per_forward("small")
    train_step_time(args.size, args.repeats)


if __name__ == "__main__":
    main()
