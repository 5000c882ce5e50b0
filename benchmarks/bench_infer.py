"""Inference latency per call, bf16 on CPU: fp32, torch.autocast, ours (O1), ours frozen (weights cast once),
and with --compile the same under torch.compile (inductor). Alternated runs, medians; one table.

    python benchmarks/bench_infer.py [--size full] [--repeats 15] [--real tv_resnet18,tv_efficientnet_b0]
    python benchmarks/bench_infer.py --compile --only mlp,bert          # inductor: minutes per model on 2 cores

--compile adds a second table: the train step (forward + backward), ours and autocast, eager and compiled.

Columns: milliseconds per call of each variant, the ratios ours/autocast and frozen/autocast, runtime casts
per call (aten._to_copy) of ours, frozen and autocast, and the bytes the frozen copies hold against the
model's fp32 parameter bytes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

import amp_compiler  # noqa: E402
from bench_convert import CastCounter, table  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

LOW = torch.bfloat16


def zoo_case(name: str, size: str):
    task = build(name, size=size)
    return task.model.eval(), task.example_inputs


def real_case(name: str):
    from real_models import REAL_MODELS
    spec = REAL_MODELS[name]
    return spec.build().eval(), spec.inputs()


def variants(model, inputs, compile_too: bool) -> dict:
    ours = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs).eval()
    frozen = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs, freeze=True).eval()

    def autocast_call(*args):
        with torch.autocast("cpu", dtype=LOW):
            return model(*args)

    runs = {"fp32": model, "autocast": autocast_call, "ours": ours, "frozen": frozen}
    if compile_too:
        compiled_model = torch.compile(model)

        def compiled_autocast(*args):
            with torch.autocast("cpu", dtype=LOW):
                return compiled_model(*args)

        runs.update({"autocast+compile": compiled_autocast, "ours+compile": torch.compile(ours),
                     "frozen+compile": torch.compile(frozen)})
    return runs, frozen


def casts(run, inputs) -> int:
    with CastCounter() as counter:
        run(*inputs)
    return counter.casts


def measure(model, inputs, repeats: int, compile_too: bool) -> dict:
    runs, frozen = variants(model, inputs, compile_too)
    with torch.inference_mode():
        for run in runs.values():            # warm-up, the frozen copies, compilation
            run(*inputs), run(*inputs)
        start = time.perf_counter()
        runs["autocast"](*inputs)
        loops = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
        samples = {name: [] for name in runs}
        for _ in range(repeats):             # alternated: drift hits every variant alike
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(loops):
                    run(*inputs)
                samples[name].append((time.perf_counter() - start) / loops * 1e3)
        row = {name: statistics.median(values) for name, values in samples.items()}
        row["casts"] = {name: casts(runs[name], inputs) for name in ("ours", "frozen", "autocast")}
    row["frozen_bytes"] = amp_compiler.frozen_bytes(frozen)
    row["fp32_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return row


def train_step(model, inputs, repeats: int) -> dict:
    """ms per train step (forward, backward) of ours and autocast, eager and compiled (inductor)."""
    model.train()
    ours = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs).train()

    def autocast_forward(*args):
        with torch.autocast("cpu", dtype=LOW):
            return model(*args)

    compiled_model = torch.compile(model)

    def compiled_autocast(*args):
        with torch.autocast("cpu", dtype=LOW):
            return compiled_model(*args)

    forwards = {"autocast": autocast_forward, "ours": ours, "autocast+compile": compiled_autocast,
                "ours+compile": torch.compile(ours)}

    def step(forward):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                forward(*inputs).float().square().mean().backward()
        return run

    runs = {name: step(forward) for name, forward in forwards.items()}
    for run in runs.values():
        run(), run()
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=("small", "full"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--real", default="", help="comma-separated names from tests/real_models.py")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (inductor) variants")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md (bench-infer; with "
                             "--compile: bench-infer-compile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    cases = [(n, lambda n=n: zoo_case(n, args.size)) for n in ZOO_NAMES if not args.only or n in args.only.split(",")]
    cases += [(n, lambda n=n: real_case(n)) for n in args.real.split(",") if n]
    names = ["fp32", "autocast", "ours", "frozen"] + (["autocast+compile", "ours+compile", "frozen+compile"]
                                                      if args.compile else [])
    import doc_tables
    with doc_tables.captured() as printed:
        tables(args, cases, names)
    if args.write_docs:
        name = "bench-infer-compile" if args.compile else "bench-infer"
        doc_tables.write_table("performance.md", name, printed.text, doc_tables.command_line())


def tables(args, cases, names) -> None:
    rows = []
    for name, make in cases:
        row = measure(*make(), args.repeats, args.compile)
        c = row["casts"]
        rows.append([name, *(f"{row[v]:.3f}" for v in names), f"{row['ours'] / row['autocast']:.2f}",
                     f"{row['frozen'] / row['autocast']:.2f}",
                     *([f"{row['frozen+compile'] / row['autocast+compile']:.2f}"] if args.compile else []),
                     f"{c['ours']}/{c['frozen']}/{c['autocast']}",
                     f"{row['frozen_bytes'] / 1e6:.2f}/{row['fp32_bytes'] / 1e6:.2f}"])
        print("  ".join(rows[-1]), file=sys.stderr, flush=True)   # progress; stdout is the table
    table(f"inference ms per call, bf16, CPU, {args.threads} thread(s), {args.size} zoo, median of {args.repeats} "
          "alternated runs", ["model", *names, "ours/ac", "frozen/ac",
                              *(["frozen+c/ac+c"] if args.compile else []), "casts ours/frozen/ac",
                              "frozen MB/fp32 MB"], rows)
    if not args.compile:
        return
    train_rows = []
    for name, make in cases:
        ms = train_step(*make(), args.repeats)
        train_rows.append([name, *(f"{ms[k]:.2f}" for k in ms), f"{ms['ours'] / ms['autocast']:.2f}",
                           f"{ms['ours+compile'] / ms['autocast+compile']:.2f}"])
        print("  ".join(train_rows[-1]), file=sys.stderr, flush=True)
    table(f"train step (forward + backward) ms, bf16, CPU, {args.threads} thread(s), median of {args.repeats}",
          ["model", "autocast", "ours", "autocast+compile", "ours+compile", "ours/ac", "ours+c/ac+c"], train_rows)


if __name__ == "__main__":
    main()
