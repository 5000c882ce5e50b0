"""Real architectures (tests/real_models.py: tiny configs, random init), O1 bf16 against torch.autocast.

Per model and per family (medians): convert() seconds, casts per forward (dtype-changing aten._to_copy
at run time) ours / autocast, bf16 train step (forward + backward) ours / autocast, and inference
ours / autocast. One thread, alternated runs, medians of --repeats.

    python benchmarks/bench_real_models.py [--repeats 5] [--only hf_bert_sdpa,tv_resnet18]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_convert import CastCounter  # noqa: E402
from real_models import REAL_MODELS  # noqa: E402

import amp_compiler  # noqa: E402

LOW = torch.bfloat16


def _casts(run) -> int:
    with torch.no_grad(), CastCounter() as counter:
        run()
    return counter.casts


def _loops_for(run, target_s: float = 0.05) -> int:
    """How many calls make one sample last about `target_s` (millisecond calls are timer noise alone)."""
    start = time.perf_counter()
    run()
    return max(1, int(target_s / max(time.perf_counter() - start, 1e-6)))


def _seconds(run, loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        run()
    return (time.perf_counter() - start) / loops


def measure(name: str, repeats: int) -> dict:
    spec = REAL_MODELS[name]
    model, inputs = spec.build(), spec.inputs()
    start = time.perf_counter()
    gm = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs)
    convert_s = time.perf_counter() - start

    def ours():
        return spec.output(gm(*inputs))

    def autocast():
        with torch.autocast("cpu", dtype=LOW):
            return spec.output(model(*inputs))

    def step(forward):
        def run():
            forward().float().sum().backward()
        return run

    row = {"family": spec.family, "convert_s": convert_s,
           "casts": _casts(ours), "autocast_casts": _casts(autocast)}
    for label, ours_run, theirs_run, grad in (("infer", ours, autocast, False),
                                              ("train", step(ours), step(autocast), True)):
        with torch.set_grad_enabled(grad):
            loops = _loops_for(theirs_run)                             # also the warm-up
            ours_run()
            pairs = [(_seconds(ours_run, loops), _seconds(theirs_run, loops)) for _ in range(repeats)]
        row[label] = statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated model names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = [n for n in REAL_MODELS if not args.only or n in args.only.split(",")]
    rows: dict[str, dict] = {}
    print(f"{'model':<26}{'convert s':>10}{'casts ours/ac':>15}{'train ours/ac':>15}{'infer ours/ac':>15}")
    for name in names:
        try:
            row = measure(name, args.repeats)
        except Exception as error:  # noqa: BLE001 - one model's failure is a row, not the end of the table
            print(f"{name:<26}  FAILED: {type(error).__name__}: {str(error).splitlines()[0][:90]}", flush=True)
            continue
        rows[name] = row
        print(f"{name:<26}{row['convert_s']:>10.2f}{row['casts']:>8}/{row['autocast_casts']:<6}"
              f"{row['train']:>15.2f}{row['infer']:>15.2f}", flush=True)
    by_family = defaultdict(list)
    for row in rows.values():
        by_family[row["family"]].append(row)
    print(f"\n{'family (medians)':<26}{'convert s':>10}{'casts ours/ac':>15}{'train ours/ac':>15}{'infer ours/ac':>15}")
    for family, group in by_family.items():
        med = {k: statistics.median(r[k] for r in group) for k in ("convert_s", "casts", "autocast_casts",
                                                                   "train", "infer")}
        print(f"{family:<26}{med['convert_s']:>10.2f}{med['casts']:>8.0f}/{med['autocast_casts']:<6.0f}"
              f"{med['train']:>15.2f}{med['infer']:>15.2f}")


if __name__ == "__main__":
    main()
