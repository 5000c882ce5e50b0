"""Make the inputs an ONNX schema ties to one type agree, casting the odd ones to the data's dtype.

    LayerNormalization(X: f16, Scale: f32, B: f32)   ->   LayerNormalization(X, Cast(Scale, f16), Cast(B, f16))
    Conv(X: f16, W: f32)   (batch norm folded into W by the exporter's optimizer)   ->   Conv(X, Cast(W, f16))

torch runs norms on fp16 data with fp32 weights, and torch.onnx writes that down although the schema's
T ... T constraint forbids it (pytorch #106298 #158658): the model fails onnx.checker and ONNX Runtime.
The first float input of each type group (the data: X, A, input) sets the dtype the group computes in,
which is the dtype the node's outputs already have. fold_onnx_casts then stores the cast weights in it.
Only the export path needs this; convert_onnx builds consistent types by construction.
"""
from __future__ import annotations

from collections import defaultdict

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, make_cast
from amp_compiler.passes.onnx.spec import is_float_value, schema_input
from amp_compiler.passes.runner import PassResult


def unify_onnx_input_types(model: ir.Model) -> PassResult:
    names = UniqueNames(model)
    shared: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
    opset = model.opset_imports.get("", 1)
    cast = 0
    for node in list(all_nodes(model.graph)):
        if node.domain not in ("", "ai.onnx"):
            continue
        for indices in _type_groups(node.op_type, opset, len(node.inputs)):
            floats = [i for i in indices if is_float_value(node.inputs[i])]
            if len({node.inputs[i].dtype for i in floats}) < 2:
                continue
            target = node.inputs[floats[0]].dtype
            for i in floats[1:]:
                value = node.inputs[i]
                if value.dtype != target:
                    if (value, target) not in shared:
                        shared[value, target] = make_cast(value, target, names).outputs[0]
                        cast += 1
                    node.replace_input_with(i, shared[value, target])
    return PassResult(modified=cast > 0, counts={"mixed_dtype_inputs_cast": cast})


def _type_groups(op_type: str, opset: int, arity: int) -> list[list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for index in range(arity):
        formal = schema_input(op_type, opset, index)
        if formal is not None and formal[0] is not None:
            groups[formal[0]].append(index)
    return [g for g in groups.values() if len(g) > 1]
