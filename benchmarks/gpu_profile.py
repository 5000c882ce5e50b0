"""Where a converted model's time goes against autocast's, kernel by kernel (torch.profiler), on one model.

    python benchmarks/gpu_profile.py hf_bert            # CUDA, fp16 inference, BERT-base shaped config
    python benchmarks/gpu_profile.py hf_bert --dry-run  # CPU, tiny sizes: keeps the script working

Prints, for autocast and for ours (O1), the operators that take the most device time (CPU time on a dry run),
and the difference per operator: what the converted graph runs that the eager model does not.
Models: those of benchmarks/gpu.py (its real_cases and the zoo).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

import amp_compiler  # noqa: E402
from gpu import real_cases, to_device, zoo_cases  # noqa: E402


def operator_times(run, inputs, device: str, repeats: int) -> dict[str, tuple[float, int]]:
    """Operator -> (ms per call of self device time, calls per call), over `repeats` calls."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.inference_mode():
        for _ in range(3):
            run(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(repeats):
                run(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        spent = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if spent > 0:
            times[event.key] = (spent / 1e3 / repeats, event.count // repeats)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.bfloat16 if args.dry_run else torch.float16
    cases = {c.name: c for c in [*zoo_cases(args.dry_run), *real_cases(args.dry_run)]}
    case = to_device(cases[args.model], device)
    model = case.model.eval()
    gm = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=case.inputs).eval()

    def autocast(*inputs):
        with torch.autocast(device, dtype=dtype):
            return model(*inputs)

    repeats = 2 if args.dry_run else 20
    theirs = operator_times(autocast, case.inputs, device, repeats)
    ours = operator_times(gm, case.inputs, device, repeats)
    unit = "device" if device == "cuda" else "CPU"
    for name, times in (("autocast", theirs), ("ours O1", ours)):
        total = sum(ms for ms, _ in times.values())
        print(f"\n{name}: {total:.3f} ms of {unit} time per call; top operators (self time)")
        for key, (ms, calls) in sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {ms:9.3f} ms  {calls:5d} calls  {key[:110]}")
    print(f"\nours - autocast, per call (largest differences first)")
    keys = set(theirs) | set(ours)
    diff = {k: ours.get(k, (0, 0))[0] - theirs.get(k, (0, 0))[0] for k in keys}
    for key in sorted(keys, key=lambda k: -abs(diff[k]))[:args.top]:
        print(f"  {diff[key]:+9.3f} ms  calls {theirs.get(key, (0, 0))[1]:4d} -> {ours.get(key, (0, 0))[1]:4d}  "
              f"{key[:110]}")


if __name__ == "__main__":
    main()
