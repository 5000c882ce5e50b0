"""Range calibration against the peers, on the same fp32 ONNX models: which nodes each keeps fp32 so that
fp16 holds the values, what that costs, and what comes out.

    ours:    convert_onnx(src, dst, level="O1", calibration_data=samples)   (one fp32 ORT session, all samples)
    plain:   convert_onnx(src, dst, level="O1")                             (no calibration, the baseline)
    peer:    onnxconverter-common auto_convert_mixed_precision(model, feed, rtol, atol, keep_io_types=True)
             (bisection over node lists: one ORT session per attempt, on one feed)
    peer:    NVIDIA ModelOpt AutoCast (modelopt.onnx.autocast), a row saying so when it is not importable

Per row: conversion seconds (load + convert + save), ONNX Runtime sessions the conversion created (every
onnxruntime.InferenceSession made while it ran is counted), float nodes computing fp16 / fp32 in the output
(non-Cast nodes by their float output types after ONNX shape inference), the max error against the fp32
model on held-out inputs (relative to the output's scale, ONNX Runtime CPU), and whether those outputs are
finite. The CPU provider runs many fp16 ops in fp32 (it casts around kernels it lacks), so an fp16
overflow can stay invisible there; "finite (fp16 math)" runs the file in onnx.reference (numpy, true
fp16 arithmetic) where the model is small enough, "-" otherwise.

Models: a planted overflow (Linear -> x * 400 * 250 -> Linear, tests/convert/test_calibration.py's Planted), the
zoo (models/), and real models (tests/real_models.py). Samples: the model's example inputs with float
inputs redrawn (same mean/std) and integer inputs redrawn in their observed range, seeded; held-out
inputs are drawn the same way with another seed.

    python benchmarks/bench_calibration.py [--models planted mlp resnet tv_resnet18 hf_bert_sdpa] [--samples 8]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]
import models.torchvision_ops  # noqa: E402,F401  (torchvision's missing op schemas, before anything imports it)

from amp_compiler import convert_onnx  # noqa: E402
from amp_compiler.onnx.export import export_fp32_reference  # noqa: E402
from bench_onnx import load_model, table  # noqa: E402

DEFAULT_MODELS = ("planted", "mlp", "resnet", "bert", "gpt", "gcn", "gat", "tv_resnet18", "hf_bert_sdpa",
                  "hf_gpt2_sdpa")
REFERENCE_EVALUATOR_NODES = 400   # onnx.reference is pure numpy: larger graphs take minutes


class Planted(nn.Module):
    """An activation scaled by 1e5 between two matmuls (as tests/convert/test_calibration.py builds it on fx)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x) * 400.0 * 250.0)


class SessionCounter:
    """Counts every onnxruntime.InferenceSession created while it is active (ours and the peers' alike)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        real, counter = ort.InferenceSession, self

        class Counted(real):
            def __init__(self, *args, **kwargs):
                counter.count += 1
                super().__init__(*args, **kwargs)

        self.real, ort.InferenceSession = real, Counted
        return self

    def __exit__(self, *exc):
        ort.InferenceSession = self.real


def draw(example: tuple, seed: int) -> tuple:
    """Inputs shaped as `example`: floats redrawn with its mean and std, integers in its observed range."""
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    for x in example:
        if x.is_floating_point():
            std = float(x.std()) if x.numel() > 1 else 1.0
            drawn.append(torch.randn(x.shape, generator=generator) * (std or 1.0) + float(x.mean()))
        elif x.dtype == torch.bool:
            drawn.append(x.clone())
        else:
            low, high = int(x.min()), int(x.max())
            drawn.append(torch.randint(low, high + 1, x.shape, generator=generator, dtype=x.dtype))
    return tuple(drawn)


def source_model(name: str) -> tuple[nn.Module, tuple]:
    if name == "planted":
        return Planted().eval(), (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)
    return load_model(name, "small")


def feeds_of(path: str, inputs: tuple) -> dict:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}


def float_nodes(path: str) -> tuple[int, int]:
    """(nodes with an fp16 output, nodes with an fp32 output): Casts and Constants not counted."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    low = fp32 = 0
    for node in model.graph.node:
        if node.op_type in ("Cast", "Constant"):
            continue
        out = {types.get(o) for o in node.output if o}
        low += onnx.TensorProto.FLOAT16 in out
        fp32 += onnx.TensorProto.FLOAT in out
    return low, fp32


def outcome(path: str, reference: list, feeds: dict) -> dict:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    outputs = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    error = max(_relative_error(o, r) for o, r in zip(outputs, reference))
    finite = all(np.isfinite(np.asarray(o, np.float64)).all() for o in outputs)
    model = onnx.load(path)
    exact = "-"
    if len(model.graph.node) <= REFERENCE_EVALUATOR_NODES:
        from onnx.reference import ReferenceEvaluator
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # numpy's overflow warnings: that is what we look for
                values = ReferenceEvaluator(model).run(None, {i.name: feeds[i.name] for i in model.graph.input})
            exact = "yes" if all(np.isfinite(np.asarray(v, np.float64)).all() for v in values) else "no"
        except Exception:  # noqa: BLE001
            exact = "n/a"       # an op or attribute onnx.reference does not implement
    return {"error": error, "finite": "yes" if finite else "no", "exact": exact}


def _relative_error(output, reference) -> float:
    output, reference = np.asarray(output, np.float64), np.asarray(reference, np.float64)
    if not np.isfinite(output).all():
        return float("inf")
    return float(np.abs(output - reference).max() / max(np.abs(reference).max(), 1e-6))


def ours(src: str, dst: str, samples: list, calibrate: bool) -> dict:
    report = convert_onnx(src, dst, "O1", calibration_data=samples if calibrate else None, progress=False)
    return {"range_kept": sum(1 for r in report.rows if r["rule"].startswith("range:"))}


def onnxconverter_common(src: str, dst: str, samples: list, feeds: list[dict], rtol: float, atol: float) -> dict:
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # it warns about every value it clamps
        converted = auto_convert_mixed_precision(onnx.load(src), feeds[0], rtol=rtol, atol=atol, keep_io_types=True)
    onnx.save(converted, dst)
    return {}


def modelopt_autocast(src: str, dst: str, samples: list, feeds: list[dict], rtol: float, atol: float) -> dict:
    from modelopt.onnx.autocast import convert_to_mixed_precision   # not installed here: the row says so
    converted = convert_to_mixed_precision(onnx_path=src, low_precision_type="fp16", keep_io_types=True)
    onnx.save(converted, dst)
    return {}


def bench_model(name: str, args, scratch: str) -> list[list]:
    model, example = source_model(name)
    src = os.path.join(scratch, f"{name}.onnx")
    export_fp32_reference(model, example, src)
    samples = [draw(example, seed) for seed in range(1, args.samples + 1)]
    held_out = draw(example, 10_000)
    numpy_samples = [tuple(x.numpy() for x in s) for s in samples]
    feeds = [feeds_of(src, s) for s in samples]
    held_feeds = feeds_of(src, held_out)
    reference = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, held_feeds)
    low, fp32 = float_nodes(src)
    rows = [[name, "fp32 source", "-", "-", low, fp32, "-", 0.0, *_finite_columns(outcome(src, reference, held_feeds))]]
    candidates = {
        "O1 (no calibration)": lambda dst: ours(src, dst, numpy_samples, calibrate=False),
        f"O1 calibrated ({args.samples})": lambda dst: ours(src, dst, numpy_samples, calibrate=True),
        "onnxconverter-common auto": lambda dst: onnxconverter_common(src, dst, samples, feeds, args.rtol, args.atol),
        "ModelOpt AutoCast": lambda dst: modelopt_autocast(src, dst, samples, feeds, args.rtol, args.atol),
    }
    for label, run in candidates.items():
        dst = os.path.join(scratch, f"{name}_{len(rows)}.onnx")
        with SessionCounter() as sessions:
            started = time.perf_counter()
            try:
                extra = run(dst)
            except ImportError as error:
                rows.append([name, label, "not installed", "-", "-", "-", "-", "-", "-", "-"])
                print(f"# {name} / {label}: {error}", file=sys.stderr)
                continue
            except Exception as error:  # noqa: BLE001 - a converter that refuses the model is a row, not a crash
                # what failing cost: its time and sessions
                rows.append([name, label, f"fails ({time.perf_counter() - started:.2f})", sessions.count,
                             "-", "-", "-", "-", "-", "-"])
                print(f"# {name} / {label}: {type(error).__name__}: {str(error).splitlines()[0][:160]}",
                      file=sys.stderr)
                continue
            seconds = time.perf_counter() - started
        low, fp32 = float_nodes(dst)
        result = outcome(dst, reference, held_feeds)
        rows.append([name, label, f"{seconds:.2f}", sessions.count, low, fp32, extra.get("range_kept", "-"),
                     result["error"], *_finite_columns(result)])
    return rows


def _finite_columns(result: dict) -> list:
    return [result["finite"], result["exact"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--samples", type=int, default=8, help="calibration samples (the peer validates on the first)")
    parser.add_argument("--rtol", type=float, default=1e-2, help="onnxconverter-common's np.allclose rtol")
    parser.add_argument("--atol", type=float, default=1e-3, help="onnxconverter-common's np.allclose atol")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            started = time.perf_counter()
            rows += bench_model(name, args, scratch)
            print(f"# {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    for row in rows:
        row[7] = row[7] if isinstance(row[7], str) else f"{row[7]:.2e}"
    print(f"O1 fp16, ONNX Runtime {ort.__version__} CPU; error on held-out inputs, relative to the output's scale; "
          f"onnxconverter-common validates with np.allclose(rtol={args.rtol}, atol={args.atol}) on one feed")
    table(["model", "converter", "seconds", "ORT sessions", "fp16 nodes", "fp32 nodes", "range-kept",
           "max err", "finite (ORT)", "finite (fp16 math)"], rows)


if __name__ == "__main__":
    main()
