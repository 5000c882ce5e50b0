"""Cast placement that counts bytes (passes/painting/place_casts.py): casts and bytes cast per forward, as
painted (cast_placement=False), after placement, and torch.autocast's, O1 bf16.

Bytes are measured at run time: every dtype-changing aten._to_copy, its fp32 side (bench_convert.CastCounter).
"cut" is the pass (a minimum cut), "greedy" the one-node-at-a-time search it is compared with; "predicted" is
the pass's own figure (bytes_cast_before -> after: the values the graph shows, before fold_casts; an fx
leaf module's weights are inside the call, not counted).
Models: the zoo (models/, size full) and the real-model registry (tests/real_models.py).

    python benchmarks/bench_placement.py [--only tv_resnet18,mlp] [--zoo-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

import doc_tables

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
    for label, placement in (("painted", False), ("greedy", "greedy"), ("placed", "cut")):
        gm = amp_compiler.convert(model, "O1", dtype=LOW, example_inputs=inputs, cast_placement=placement)
        results[label] = _measure(lambda: gm(*inputs))
        if placement:
            method = placement
            counts = gm.meta["amp"].get("pass_counts", {}).get("decide_precision", {})   # {}: children converted
            results[f"{method}_predicted"] = (counts.get("bytes_cast_before", 0), counts.get("bytes_cast_after", 0))
            results[f"{method}_moved"] = counts.get("nodes_moved", 0)

    def autocast():
        with torch.autocast("cpu", dtype=LOW):
            model(*inputs)
    try:
        results["autocast"] = _measure(autocast)
    except Exception as error:  # noqa: BLE001 - say whose failure the row is
        raise RuntimeError(f"autocast raises, amp-compiler ran: {str(error).splitlines()[0]}") from error
    return results


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--zoo-only", action="store_true")
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = [n for n in args.only.split(",") if n]
    with doc_tables.captured() as printed:
        print_table(names, args.zoo_only)
    if args.write_docs:
        doc_tables.write_table("performance.md", "bench-placement", printed.text, doc_tables.command_line())


def print_table(names: list[str], zoo_only: bool) -> None:
    print(f"{'model':<24}{'casts painted/greedy/cut/ac':>28}{'MB cast painted':>16}{'greedy':>8}{'cut':>8}"
          f"{'autocast':>9}{'predicted MB painted->greedy/cut':>34}{'moved greedy/cut':>18}")
    totals = [0, 0, 0, 0]
    for name, model, inputs in _models(names, zoo_only):
        try:
            r = row(model, inputs)
        except Exception as error:  # noqa: BLE001 - one model's failure is a row, not the end of the table
            print(f"{name:<24}  FAILED: {type(error).__name__}: {str(error).splitlines()[0][:130]}", flush=True)
            continue
        measured = [r[label] for label in ("painted", "greedy", "placed", "autocast")]
        totals = [total + nbytes for total, (_, nbytes) in zip(totals, measured)]
        casts = "/".join(str(count) for count, _ in measured)
        predicted = (f"{_mb(r['cut_predicted'][0])}->{_mb(r['greedy_predicted'][1])}/"
                     f"{_mb(r['cut_predicted'][1])}")
        moved = f"{r['greedy_moved']}/{r['cut_moved']}"
        print(f"{name:<24}{casts:>28}" + "".join(f"{_mb(nbytes):>{w}}" for (_, nbytes), w in zip(measured, (16, 8, 8, 9)))
              + f"{predicted:>34}{moved:>18}", flush=True)
    print(f"{'total MB':<24}{'':>28}" + "".join(f"{_mb(t):>{w}}" for t, w in zip(totals, (16, 8, 8, 9))))


if __name__ == "__main__":
    main()
