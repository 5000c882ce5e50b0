"""validate_onnx(): does the fp16 model load, type-check and compute what the fp32 reference computes?

    report = validate_onnx("m_fp16.onnx", reference="m.onnx" | model, inputs=(x,), compare_intermediates=True)
    validate m_fp16.onnx on CPUExecutionProvider: 41 float nodes, tolerance 0.01 of each value's scale + 0.01: ...
      output node_Softmax_20 (Softmax) -> logits float32: max abs 3.1e-04, 2.2e-03 of scale, 0.3 ulp
      first node past tolerance: node_MatMul_13 (MatMul) -> val_15 float16: max abs inf, ...
      chain: node_Relu_9 -> node_MatMul_13

The report is compare()'s ComparisonReport (amp_compiler/insight/compare.py): the same per-node errors
(max abs, relative to the value's scale, ulp, non-finite), the first node past tolerance and the chain of
worst inputs that leads to it.

The checker runs with full_check on the file's path (so external data and >2 GB models work). On ONNX
Runtime's CPU provider most fp16 ops run in fp32 internally, so a CPU run checks loading, types and rough
agreement; fp16 overflow and rounding show on the CUDA provider (used when a GPU is usable) or in torch.
Intermediate tensors are matched by value name; the exporter and convert_onnx keep the source's names.
"""
from __future__ import annotations

import os
import tempfile
import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch import nn

from amp_compiler.insight.compare import FP8_RTOL, ComparisonReport, NodeError, badness, tensor_error, worst_chain
from amp_compiler.onnx.files import load_onnx_model
from amp_compiler.onnx.sessions import execution_providers, make_session
from amp_compiler.passes.onnx.infer_types import infer_onnx_types
from amp_compiler.passes.onnx.spec import is_float_value

CPU_NOTE = ("CPUExecutionProvider runs most fp16 ops in fp32: this checks loading, types and rough agreement, "
            "not fp16 overflow or rounding")
DEFAULT_RTOL = 1e-2
FLOAT8_TYPES = (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ, ir.DataType.FLOAT8E5M2,
                ir.DataType.FLOAT8E5M2FNUZ)


def validate_onnx(path, reference, inputs, *, rtol: float | None = None, atol: float = 1e-2,
                  compare_intermediates: bool = False) -> ComparisonReport:
    """Run the model at `path` and its fp32 reference (an ONNX path or the nn.Module) on `inputs`.
    rtol: relative to each value's scale; default 1e-2, or compare()'s FP8_RTOL for a file that computes
    in float8 (float8 weights, or QuantizeLinear to float8: default_onnx_rtol)."""
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
    candidate = load_onnx_model(path)
    low = _low_dtype(candidate)
    rtol, rtol_from = (rtol, "") if rtol is not None else default_onnx_rtol(candidate)
    producers = {value.name: node for node in candidate.graph for value in node.outputs}
    outputs = []
    for value, ref in zip(candidate.graph.outputs, reference_outputs):
        producer = producers.get(value.name)
        outputs.append(_error(ours[value.name], ref, low, rtol, atol, producer, value.name))
    report = ComparisonReport(low, rtol, [], outputs, notes=notes, atol=atol, source=path, providers=providers,
                              rtol_from=rtol_from)
    if compare_intermediates:
        _compare_intermediates(report, candidate, producers, ours, theirs)
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


def _compare_intermediates(report: ComparisonReport, candidate: ir.Model, producers: dict, ours: dict,
                           theirs: dict) -> None:
    """Every float value both runs computed, in graph order; the first past tolerance and its chain."""
    errors = {}
    for node in candidate.graph:
        for value in node.outputs:
            name = value.name
            if name in ours and name in theirs and ours[name].shape == theirs[name].shape and \
                    np.issubdtype(np.asarray(ours[name]).dtype, np.floating):
                errors[name] = _error(ours[name], theirs[name], report.low_dtype, report.rtol, report.atol, node, name)
    report.errors = sorted(errors.values(), key=badness, reverse=True)
    first = next((name for name, error in errors.items() if not error.ok), None)
    if first is not None:
        reads = lambda name: [v.name for v in producers[name].inputs if v is not None] if name in producers else []
        report.first_failure, report.chain = errors[first], worst_chain(first, errors, reads)


def _error(candidate, reference, low: str, rtol: float, atol: float, node, value: str) -> NodeError:
    a, b = torch.from_numpy(np.asarray(candidate)), torch.from_numpy(np.asarray(reference))
    node_name, op = (node.name, node.op_type) if node is not None else (value, "input")
    return tensor_error(a, b, low, rtol, atol, node=node_name, op=op, value=value)


def default_onnx_rtol(model: ir.Model) -> tuple[float, str]:
    """(validate_onnx's rtol for `model`, why): FP8_RTOL when it computes in float8 (what export_onnx /
    convert_onnx write at level fp8: FLOAT8E4M3FN weights, QuantizeLinear to float8 by output_dtype or by a
    float8 zero point), else DEFAULT_RTOL."""
    weights = _float8_weights(model)
    quantizers = sum(1 for node in model.graph.all_nodes() if node.op_type == "QuantizeLinear" and _to_float8(node))
    if not weights and not quantizers:
        return DEFAULT_RTOL, "default"
    found = [f"{count} {what}" for count, what in ((weights, "float8 weight" + "s" * (weights != 1)),
                                                  (quantizers, "QuantizeLinear to float8")) if count]
    return FP8_RTOL, f"fp8 default: {', '.join(found)}"


def _float8_weights(model: ir.Model) -> int:
    """float8 tensors the model stores: initializers (its subgraphs' too) and Constant nodes' values (a tool
    that folds initializers into Constants leaves a weight-only fp8 file with no float8 initializer)."""
    graphs = [model.graph, *(sub for node in model.graph.all_nodes() for attr in node.attributes.values()
                             if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                             for sub in (attr.value if attr.type == ir.AttributeType.GRAPHS else [attr.value]))]
    stored = sum(1 for graph in graphs for value in graph.initializers.values() if value.dtype in FLOAT8_TYPES)
    constants = sum(1 for node in model.graph.all_nodes()
                    if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
                    and (value := node.attributes.get("value")) is not None and value.value.dtype in FLOAT8_TYPES)
    return stored + constants


def _to_float8(node: ir.Node) -> bool:
    output_dtype = node.attributes.get("output_dtype")
    if output_dtype is not None and output_dtype.value in {int(t) for t in FLOAT8_TYPES}:
        return True
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    return zero_point is not None and zero_point.dtype in FLOAT8_TYPES


def _low_dtype(model: ir.Model) -> str:
    """float16 or bfloat16 where the model computes in it (the ulp unit), else float32."""
    values = [*(v for node in model.graph for v in node.outputs), *model.graph.initializers.values()]
    seen = {value.dtype for value in values if value.dtype is not None}
    for dtype, name in ((ir.DataType.FLOAT16, "float16"), (ir.DataType.BFLOAT16, "bfloat16")):
        if dtype in seen:
            return name
    return "float32"


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _as_input(array: np.ndarray, ort_type: str) -> np.ndarray:
    """Feed fp16 inputs (keep_io_types=False) from fp32 arrays: the session says what it takes."""
    wanted = {"tensor(float16)": np.float16, "tensor(float)": np.float32}.get(ort_type)
    return array.astype(wanted) if wanted is not None and array.dtype != wanted and \
        np.issubdtype(array.dtype, np.floating) else array
