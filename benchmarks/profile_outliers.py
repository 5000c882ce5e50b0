"""Operator-by-operator profile of ours (O1 bf16, optionally frozen) against torch.autocast for sweep models:
per-call time of each variant, then the aten ops whose self CPU time or call count differs most.

    python benchmarks/profile_outliers.py --only timm:vitamin_small_224,tv:swin_v2_t [--freeze] [--top 25]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import amp_compiler.models.torchvision_ops  # noqa: E402,F401  torchvision's C ops
import torch  # noqa: E402

import amp_compiler  # noqa: E402
from sweep_vision import build, freeze_garbage  # noqa: E402

LOW = torch.bfloat16


def variants(model, inputs, freeze: bool) -> dict:
    ours = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs, freeze=freeze,
                                inplace=False).eval()

    def autocast_call(*args):
        with torch.autocast("cpu", dtype=LOW):
            return model(*args)

    return {"autocast": autocast_call, "ours": ours}


def median_ms(runs: dict, inputs, rounds: int) -> dict:
    samples = defaultdict(list)
    for _ in range(rounds):                      # alternated: drift hits both alike
        for name, run in runs.items():
            start = time.perf_counter()
            run(*inputs)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def op_table(run, inputs, calls: int = 3) -> dict:
    """{aten op: (calls per run, self CPU ms per run)} over `calls` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run(*inputs)
    table = {}
    for event in prof.key_averages():
        table[event.key] = (event.count / calls, event.self_cpu_time_total / 1e3 / calls)
    return table


def compare(ours: dict, autocast: dict, top: int) -> None:
    keys = set(ours) | set(autocast)
    rows = sorted(keys, key=lambda k: -abs(ours.get(k, (0, 0))[1] - autocast.get(k, (0, 0))[1]))
    print(f"{'op':44s} {'n ours':>7s} {'n ac':>7s} {'ms ours':>8s} {'ms ac':>8s} {'delta':>8s}")
    for key in rows[:top]:
        (n_o, t_o), (n_a, t_a) = ours.get(key, (0, 0.0)), autocast.get(key, (0, 0.0))
        print(f"{key[:44]:44s} {n_o:7.0f} {n_a:7.0f} {t_o:8.2f} {t_a:8.2f} {t_o - t_a:+8.2f}")
    total_o = sum(t for _, t in ours.values())
    total_a = sum(t for _, t in autocast.values())
    print(f"{'TOTAL self':44s} {'':7s} {'':7s} {total_o:8.2f} {total_a:8.2f} {total_o - total_a:+8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for spec in args.only.split(","):
        model, inputs = build(spec, batch=1)
        runs = variants(model, inputs, args.freeze)
        freeze_garbage()
        with torch.inference_mode():
            for run in runs.values():
                run(*inputs), run(*inputs)
            times = median_ms(runs, inputs, args.rounds)
            print(f"== {spec}{' frozen' if args.freeze else ''}: ours {times['ours']:.1f} ms, autocast "
                  f"{times['autocast']:.1f} ms, ratio {times['ours'] / times['autocast']:.2f}", flush=True)
            if not args.no_profile:
                compare(op_table(runs["ours"], inputs), op_table(runs["autocast"], inputs), args.top)


if __name__ == "__main__":
    main()
