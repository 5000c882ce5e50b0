"""Cast placement that counts bytes (passes/painting/place_casts.py): casts and bytes cast per forward, as
painted (cast_placement=False), after placement, and torch.autocast's, O1 bf16.

Bytes are measured at run time: every dtype-changing aten._to_copy, its fp32 side (bench_convert.CastCounter).
"predicted" is the pass's own figure (bytes_cast_before -> after, activations and weights, before fold_casts).
Models: the zoo (models/, size full) and the real-model registry (tests/real_models.py).

    python benchmarks/bench_placement.py [--only tv_resnet18,mlp] [--zoo-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from bench_convert import CastCounter  # noqa: E402

import amp_compiler  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

LOW = torch.bfloat16


def _measure(run) -> tuple[int, int]:
    with torch.no_grad(), CastCounter() as counter:
        run()
    return counter.casts, counter.bytes


def _models(names: list[str], zoo_only: bool):
    for name in ZOO_NAMES:
        if not names or name in names:
            task = build(name, size="full")
            yield name, task.model.eval(), task.example_inputs
    if zoo_only:
        return
    from real_models import REAL_MODELS
    for name, spec in REAL_MODELS.items():
        if not names or name in names:
            yield name, spec.build(), spec.inputs()


def row(model, inputs) -> dict:
    results = {}
    for label, placement in (("painted", False), ("placed", True)):
        gm = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs, cast_placement=placement)
        results[label] = _measure(lambda: gm(*inputs))
        if placement:
            counts = gm.meta["amp"].get("pass_counts", {}).get("decide_precision", {})   # {}: children converted
            results["predicted"] = (counts.get("bytes_cast_before", 0), counts.get("bytes_cast_after", 0))
            results["moved"] = counts.get("nodes_moved", 0)

    def autocast():
        with torch.autocast("cpu", dtype=LOW):
            model(*inputs)
    results["autocast"] = _measure(autocast)
    return results


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--zoo-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = [n for n in args.only.split(",") if n]
    header = (f"{'model':<24}{'casts painted/placed/ac':>24}{'MB cast painted':>16}{'placed':>8}{'autocast':>9}"
              f"{'predicted MB':>15}{'moved':>6}")
    print(header)
    totals = [0, 0, 0]
    for name, model, inputs in _models(names, args.zoo_only):
        try:
            r = row(model, inputs)
        except Exception as error:  # noqa: BLE001 - one model's failure is a row, not the end of the table
            print(f"{name:<24}  FAILED: {type(error).__name__}: {str(error).splitlines()[0][:90]}", flush=True)
            continue
        (pc, pb), (qc, qb), (ac, ab) = r["painted"], r["placed"], r["autocast"]
        totals = [totals[0] + pb, totals[1] + qb, totals[2] + ab]
        predicted = f"{_mb(r['predicted'][0])}->{_mb(r['predicted'][1])}"
        print(f"{name:<24}{f'{pc}/{qc}/{ac}':>24}{_mb(pb):>16}{_mb(qb):>8}{_mb(ab):>9}{predicted:>15}{r['moved']:>6}", flush=True)
    print(f"{'total MB':<24}{'':>24}{_mb(totals[0]):>16}{_mb(totals[1]):>8}{_mb(totals[2]):>9}")


if __name__ == "__main__":
    main()
