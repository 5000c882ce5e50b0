"""How ONNX ops tie dtypes to their inputs, outputs and attributes: spec facts the fp16 rewrite respects.

    Resize(X, roi, scales)          roi/scales keep their own float type: only X follows the node's precision
    LayerNormalization -> Y, Mean, InvStdDev     Mean/InvStdDev follow stash_type (fp32), not X
    Cast(ConstantOfShape(value=f32 0), f16)      ->  ConstantOfShape(value=f16 0): the dtype is an attribute
    RandomNormalLike(x, dtype=f32) painted low   ->  RandomNormalLike(x_f16, dtype=f16)

Pure data plus small predicates; the passes decide, this module only says what the spec allows.
"""
from __future__ import annotations

from collections import UserDict
from functools import lru_cache

import numpy as np
import onnx
import onnx_ir as ir

FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

# Inputs whose float type is independent of the data type; they keep the dtype the source model gave them.
OWN_DTYPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Resize": (1, 2),       # roi: T2, scales: tensor(float) only (onnxconverter-common #207 #208 #306)
    "Upsample": (1,),       # scales: tensor(float) only
    "Dropout": (1,),        # ratio: T1, any float type, unrelated to the data
}
# Outputs whose dtype an attribute fixes, whatever the precision of the node.
OWN_DTYPE_OUTPUTS: dict[str, tuple[int, ...]] = {
    "LayerNormalization": (1, 2),   # Mean, InvStdDev follow stash_type (fp32 by default): fp32 statistics
}
# Painted ops whose output dtype is an attribute: it is set to the node's precision. Their input is cast
# like data although only its shape matters: ONNX Runtime's CPU kernels take fp16 out only with fp16 in.
DTYPE_ATTRIBUTE_FOLLOWS_PRECISION = {"RandomNormalLike": "dtype", "RandomUniformLike": "dtype"}
# Ops with non-float outputs that accept any float type, as long as their float inputs agree.
READS_ANY_FLOAT = {"Shape", "Size", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN",
                   "IsInf", "ArgMax", "ArgMin", "NonZero"}
# Constant sources: a Cast of their output folds into their value. The other sources with a dtype attribute
# (RandomNormal, RandomUniform, EyeLike) keep fp32 and one Cast: ONNX Runtime's CPU provider has no kernel
# that makes fp16 from nothing or from an fp32 template (their attribute always matches their output).
CONSTANT_SOURCES = ("Constant", "ConstantOfShape")
# Kernels ONNX Runtime registers for fp16 that refuse it at run time (CPU EP, onnxruntime 1.31):
# (op type, reduction attribute). Painting keeps these fp32 at every level.
ORT_REFUSES_FLOAT16 = {("ScatterND", "add"), ("ScatterND", "mul"), ("ScatterND", "max"), ("ScatterND", "min"),
                       ("ScatterElements", "add"), ("ScatterElements", "mul")}
LOW_IR_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}   # by torch's dtype name


def ir_low_dtype(name: str) -> ir.DataType:
    """The ONNX type of a conversion's low dtype, named as torch names it ("float16", "bfloat16")."""
    return LOW_IR_DTYPES[name]


_TYPE_STRINGS = {ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)",
                 ir.DataType.FLOAT: "tensor(float)"}


def is_float_type(dtype) -> bool:
    """fp32/fp16/bf16: what AMP may change. fp64, integers, bools, strings are never touched."""
    return dtype in FLOAT_TYPES


def tensor_dtype(value: ir.Value | None):
    """The element type of a tensor value, None for absent inputs, sequences, optionals or unknown types."""
    if value is None or not isinstance(value.type, ir.TensorType):
        return None
    return value.dtype


def is_float_value(value: ir.Value | None) -> bool:
    return is_float_type(tensor_dtype(value))


def is_onnx_op(node: ir.Node, *op_types: str) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in op_types


def subgraphs_of(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    attributes = node.attributes
    if not attributes:   # most nodes: nothing to look at
        return graphs
    # Every pass walks every graph through here; ir.Attributes is a UserDict, whose .values() looks each key
    # up again through Mapping: its plain dict (.data) halves the cost of a walk.
    for attr in (attributes.data if isinstance(attributes, UserDict) else attributes).values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def input_role(node: ir.Node, index: int) -> str:
    """'data' (follows the node's precision) or 'own' (a float type the spec fixes apart from the data)."""
    if node.domain in ("", "ai.onnx") and index in OWN_DTYPE_INPUTS.get(node.op_type, ()):
        return "own"
    return "data"


def follows_precision(node: ir.Node, output_index: int) -> bool:
    """Whether a float output of a painted node takes the node's precision."""
    return not (node.domain in ("", "ai.onnx") and output_index in OWN_DTYPE_OUTPUTS.get(node.op_type, ()))


def cast_pair_folds(source, middle, target) -> bool:
    """Cast(Cast(x: source, middle), target) computes exactly Cast(x, target) (onnxscript's CastCast idea).

    True when the first cast is exact (it widens), or when integers/bools reach fp16 through fp32: every
    integer fp16 can hold below 65520 converts to fp32 exactly, and every larger one becomes inf either way.
    fp32 -> fp16 -> fp32 is never folded: the round trip rounds (ORT stopped removing it in 1.17).
    """
    if _exact(source, middle):
        return True
    integer_source = source is not None and (source.is_integer() or source == ir.DataType.BOOL)
    return integer_source and middle == ir.DataType.FLOAT and target == ir.DataType.FLOAT16


def _exact(source, target) -> bool:
    if source is None or target is None:
        return False
    if source == target or source == ir.DataType.BOOL:
        return True
    if ir.DataType.BFLOAT16 in (source, target):
        wider = {ir.DataType.FLOAT, ir.DataType.DOUBLE}
        return (source == ir.DataType.BFLOAT16 and target in wider) or \
            (target == ir.DataType.BFLOAT16 and source in (ir.DataType.INT8, ir.DataType.UINT8))
    try:
        return bool(np.can_cast(source.numpy(), target.numpy(), casting="safe"))
    except TypeError:   # string/complex/float8 types: never assume exactness
        return False


def low_precision_blocker(node: ir.Node, low: ir.DataType, opset: int) -> str | None:
    """Why `node` cannot run in `low` at all (its ONNX schema or ONNX Runtime rejects it), else None."""
    if node.domain not in ("", "ai.onnx"):
        return None
    reduction = node.attributes.get("reduction")
    if low == ir.DataType.FLOAT16 and reduction is not None and \
            (node.op_type, reduction.as_string()) in ORT_REFUSES_FLOAT16:
        return f"ONNX Runtime has no float16 {node.op_type} kernel with reduction='{reduction.as_string()}'"
    for index, value in enumerate(node.inputs):
        formal = schema_input(node.op_type, opset, index)
        if formal is not None and is_float_value(value) and input_role(node, index) == "data" and \
                _TYPE_STRINGS[low] not in formal[1]:
            return f"the ONNX schema of {node.op_type} takes no {_TYPE_STRINGS[low]} for input {index}"
    return None


def schema_input(op_type: str, opset: int, index: int) -> tuple[str | None, frozenset] | None:
    """(type parameter such as 'T' or None when spelled out, allowed tensor types) of input `index` of a
    default-domain op; None when onnx has no schema for it. Variadic inputs repeat the last parameter."""
    formals = _schema_inputs(op_type, opset)
    return formals[min(index, len(formals) - 1)] if formals else None


@lru_cache(maxsize=None)
def _schema_inputs(op_type: str, opset: int) -> tuple | None:
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    constraints = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    return tuple((i.type_str if i.type_str in constraints else None,
                  constraints.get(i.type_str, frozenset({i.type_str}))) for i in schema.inputs)
