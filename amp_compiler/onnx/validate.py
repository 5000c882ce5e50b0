"""validate_onnx(): does the fp16 model load, type-check and compute what the fp32 reference computes?

    report = validate_onnx("m_fp16.onnx", reference="m.onnx" | model, inputs=(x,), compare_intermediates=True)
    output logits: max abs 3.1e-04, max rel 2.2e-03  ok
    first drifting node: node_MatMul_13 (MatMul) -> val_15: max abs 0.8, max rel 1.2

The checker runs with full_check on the file's path (so external data and >2 GB models work). On ONNX
Runtime's CPU provider most fp16 ops run in fp32 internally, so a CPU run checks loading, types and rough
agreement; fp16 overflow and rounding show on the CUDA provider (used when a GPU is usable) or in torch.
Intermediate tensors are matched by value name; the exporter and convert_onnx keep the source's names.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch import nn

from amp_compiler.onnx.files import load_onnx_model
from amp_compiler.onnx.sessions import execution_providers, make_session
from amp_compiler.passes.onnx.infer_types import infer_onnx_types
from amp_compiler.passes.onnx.spec import is_float_value

CPU_NOTE = ("CPUExecutionProvider runs most fp16 ops in fp32: this checks loading, types and rough agreement, "
            "not fp16 overflow or rounding")


@dataclass
class TensorError:
    name: str
    shape: tuple
    max_abs_error: float
    max_rel_error: float     # over elements where |reference| > atol; smaller ones are judged by abs error
    ok: bool                 # |a - b| <= atol + rtol * |b| everywhere (inf must meet an equal inf)

    def __str__(self) -> str:
        return (f"{self.name}: max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}  "
                f"{'ok' if self.ok else 'MISMATCH'}")


@dataclass
class DriftingNode:
    node: str
    op_type: str
    error: TensorError

    def __str__(self) -> str:
        return f"first drifting node: {self.node} ({self.op_type}) -> {self.error}"


@dataclass
class ValidationReport:
    path: str
    providers: list[str]
    outputs: list[TensorError]
    rtol: float
    atol: float
    first_drift: DriftingNode | None = None
    intermediates_compared: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(e.ok for e in self.outputs)

    def __str__(self) -> str:
        lines = [f"validate {self.path} on {self.providers[0]} (rtol={self.rtol:g}, atol={self.atol:g}): "
                 f"{'passed' if self.passed else 'FAILED'}"]
        lines += [f"  output {e}" for e in self.outputs]
        if self.intermediates_compared:
            lines.append(f"  {self.first_drift or 'no intermediate tensor drifts'} "
                         f"({self.intermediates_compared} intermediate tensors compared)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def validate_onnx(path, reference, inputs, *, rtol: float = 1e-2, atol: float = 1e-2,
                  compare_intermediates: bool = False) -> ValidationReport:
    """Run the model at `path` and its fp32 reference (an ONNX path or the nn.Module) on `inputs`."""
    path = os.fspath(path)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    load_onnx_model(path)                       # clear error for a missing or non-ONNX file
    onnx.checker.check_model(path, full_check=True)
    arrays = [_numpy(x) for x in inputs]
    providers = execution_providers()
    notes = [] if providers[0] == "CUDAExecutionProvider" else [CPU_NOTE]
    with tempfile.TemporaryDirectory() as scratch:
        if compare_intermediates:
            reference_path = _reference_onnx(reference, inputs, scratch)
            ours = _run_all(path, arrays, scratch, "candidate")
            theirs = _run_all(reference_path, arrays, scratch, "reference")
            reference_outputs = [theirs[name] for name in _output_names(reference_path)]
        else:
            ours = _run(path, arrays)
            reference_outputs = _run_module(reference, inputs) if isinstance(reference, nn.Module) else \
                list(_run(_reference_onnx(reference, inputs, scratch), arrays).values())
    output_names = _output_names(path)
    errors = [_compare(name, ours[name], ref, rtol, atol) for name, ref in zip(output_names, reference_outputs)]
    report = ValidationReport(path, providers, errors, rtol, atol, notes=notes)
    if compare_intermediates:
        report.first_drift, report.intermediates_compared = _first_drift(path, ours, theirs, rtol, atol)
    return report


def _reference_onnx(reference, inputs, scratch: str) -> str:
    if isinstance(reference, nn.Module):
        exported = os.path.join(scratch, "reference_fp32.onnx")
        from amp_compiler.onnx.export import export_fp32_reference
        export_fp32_reference(reference, tuple(inputs), exported)
        return exported
    load_onnx_model(reference)
    return os.fspath(reference)


def _run(path: str, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    session = make_session(path)
    feed = {i.name: _as_input(a, i.type) for i, a in zip(session.get_inputs(), arrays)}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))


def _run_all(path: str, arrays, scratch: str, tag: str) -> dict[str, np.ndarray]:
    """Run with every float tensor of the main graph exposed as an output (outputs first, in order)."""
    model = load_onnx_model(path)
    infer_onnx_types(model, verify_rewrite=False)     # a source model may carry no value_info
    exposed = {v.name for v in model.graph.outputs}
    for node in model.graph:
        for value in node.outputs:
            if is_float_value(value) and value.name not in exposed:
                model.graph.outputs.append(value)
                exposed.add(value.name)
    copy = os.path.join(scratch, f"{tag}.onnx")
    ir.save(model, copy, external_data=f"{tag}.onnx.data")
    return _run(copy, arrays)


def _run_module(module: nn.Module, inputs) -> list[np.ndarray]:
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            result = module(*[torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x for x in inputs])
    finally:
        module.train(was_training)
    flat = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    return [t.detach().cpu().numpy() for t in flat]


def _output_names(path: str) -> list[str]:
    return [o.name for o in load_onnx_model(path).graph.outputs]


def _first_drift(path: str, ours: dict, theirs: dict, rtol: float, atol: float):
    compared = 0
    for node in load_onnx_model(path).graph:
        for value in node.outputs:
            if value.name in ours and value.name in theirs and ours[value.name].shape == theirs[value.name].shape:
                compared += 1
                error = _compare(value.name, ours[value.name], theirs[value.name], rtol, atol)
                if not error.ok:
                    return DriftingNode(node.name, node.op_type, error), compared
    return None, compared


def _compare(name: str, candidate, reference, rtol: float, atol: float) -> TensorError:
    a = np.asarray(candidate).astype(np.float64)
    b = np.asarray(reference).astype(np.float64)
    if a.shape != b.shape:
        return TensorError(name, a.shape, float("inf"), float("inf"), False)
    same = (a == b) | (np.isnan(a) & np.isnan(b))        # equal infinities count as agreement
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    magnitude = np.abs(b)
    large = magnitude > atol
    rel = float((diff[large] / magnitude[large]).max(initial=0.0))
    ok = bool(np.all(diff <= atol + rtol * np.where(np.isfinite(magnitude), magnitude, 0.0)))
    return TensorError(name, a.shape, float(diff.max(initial=0.0)), rel, ok)


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _as_input(array: np.ndarray, ort_type: str) -> np.ndarray:
    """Feed fp16 inputs (keep_io_types=False) from fp32 arrays: the session says what it takes."""
    wanted = {"tensor(float16)": np.float16, "tensor(float)": np.float32}.get(ort_type)
    return array.astype(wanted) if wanted is not None and array.dtype != wanted and \
        np.issubdtype(array.dtype, np.floating) else array
