"""Type the values of an ONNX model with ONNX's own inference, never by patching value_info by hand.

    fill_missing (source model):   values without a type  ->  typed by onnx.shape_inference
    verify_rewrite (after rewrite): every node output's type is erased and inferred again; inference must
                                    agree with the dtypes the rewrite meant, or the pass raises

Inference runs through onnx_ir's ShapeInferencePass, which leaves large initializers out of the proto it
hands to onnx, so models over 2 GB are inferred without hitting protobuf's limit. Graph inputs and
outputs are declarations and keep their types. Outputs of ops that onnx has no schema for (custom
domains) keep the type the rewrite gave them; they are counted in "values_typed_without_schema".
"""
from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from passes.onnx_cast_nodes import model_graphs
from passes.pass_result import PassResult


def infer_onnx_types(model: ir.Model, *, verify_rewrite: bool) -> PassResult:
    if not verify_rewrite:
        untyped = _node_outputs(model, lambda v: v.type is None)
        if untyped:
            ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        return PassResult(model, modified=bool(untyped),
                          counts={"values_typed": sum(v.type is not None for v in untyped)})
    meant = {v: (v.dtype, v.shape) for v in _node_outputs(model, lambda v: isinstance(v.type, ir.TensorType))}
    for value in meant:
        value.type, value.shape = None, None
    ShapeInferencePass(check_type=True, strict_mode=True, data_prop=True)(model)
    untyped = [v for v in meant if v.type is None]
    if meant and len(untyped) == len(meant):
        raise RuntimeError(f"ONNX type inference failed on the rewritten model: {_inference_error(model)}")
    wrong = [f"{v.name}: inferred {v.dtype.name}, rewrite meant {dtype.name}"
             for v, (dtype, _) in meant.items() if v.type is not None and v.dtype != dtype]
    if wrong:
        raise RuntimeError("the fp16 rewrite and ONNX type inference disagree on " + "; ".join(wrong[:10]))
    for value in untyped:
        value.dtype = meant[value][0]
    for value, (_, shape) in meant.items():
        if value.shape is None:
            value.shape = shape
    return PassResult(model, modified=True, counts={"values_typed_without_schema": len(untyped)})


def _node_outputs(model: ir.Model, keep) -> list[ir.Value]:
    """Values produced by nodes that are not graph outputs (those are declarations), in every graph."""
    found = []
    for graph in model_graphs(model.graph):
        for node in graph:
            found.extend(v for v in node.outputs if not v.is_graph_output() and keep(v))
    return found


def _inference_error(model: ir.Model) -> str:
    try:
        onnx.shape_inference.infer_shapes(ir.to_proto(model), check_type=True, strict_mode=True)
    except Exception as error:  # noqa: BLE001 - the message is what the caller needs
        return str(error).strip()
    return "inference typed nothing (no message from onnx)"
