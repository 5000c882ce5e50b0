"""What fp8 calibration measures on the zoo models: each low matmul's e4m3 round-trip errors on the samples.

    convert(model, "fp8", fp8_min_dim=16, calibration_data=[task.make_batch(step)[0] for step in range(8)])

Per model: the matmuls measured (passes/fx/measure_fp8_operands.py), how many the keep rule would leave bf16
at fp8_max_error (default 0.1) for per-tensor scaling (current/delayed: max(x_error, w_error)) and for row-wise
scaling (max(x_error_rowwise, w_error_rowwise)), and the largest of each error seen, with the node it was on.
The zoo models are freshly initialised (not trained): trained weights and activations may hold more outliers.

    python benchmarks/bench_fp8_calibration.py [--models gpt bert] [--size small|full] [--samples 8]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import models.torchvision_ops  # noqa: E402,F401  (torchvision's missing op schemas, before anything imports it)

import amp_compiler  # noqa: E402
from amp_compiler.passes.node_facts import facts  # noqa: E402
from amp_compiler.passes.policy.fp8 import Fp8Options  # noqa: E402
from models import build  # noqa: E402

ERRORS = ("x_error", "w_error", "x_error_rowwise", "w_error_rowwise")


def calibration_figures(name: str, size: str, samples: int) -> dict[str, dict]:
    """node name -> facts(node)["fp8_calibration"] of the model converted at fp8 on `samples` batches."""
    task = build(name, size=size)
    data = [task.make_batch(step)[0] for step in range(samples)]
    gm = amp_compiler.convert(task.model, "fp8", example_inputs=task.example_inputs, calibration_data=data,
                              fp8_min_dim=16)
    return {node.name: facts(node)["fp8_calibration"] for node in gm.graph.nodes if "fp8_calibration" in facts(node)}


def kept(figures: dict[str, dict], keys: tuple[str, str], max_error: float) -> int:
    return sum(max(f[k] for k in keys) > max_error for f in figures.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "bert"])
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-error", type=float, default=Fp8Options.max_error)
    args = parser.parse_args()
    print(f"fp8 calibration, zoo {args.size}, {args.samples} batches, fp8_max_error {args.max_error}")
    print(f"{'model':<6} {'measured':>8} {'kept/tensor':>11} {'kept/row':>8}  " + "  ".join(f"{k:<26}" for k in ERRORS))
    for name in args.models:
        figures = calibration_figures(name, args.size, args.samples)
        worst = {key: max(figures.items(), key=lambda item: item[1][key]) for key in ERRORS}
        cells = "  ".join(f"{f'{f[key]:.4f} ({node})':<26}" for key, (node, f) in worst.items())
        print(f"{name:<6} {len(figures):>8} {kept(figures, ERRORS[:2], args.max_error):>11} "
              f"{kept(figures, ERRORS[2:], args.max_error):>8}  {cells}")


if __name__ == "__main__":
    main()
