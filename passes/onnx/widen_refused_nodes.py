"""Run in fp32 the low-precision nodes ONNX Runtime refuses to execute, with casts around them.

    y = ScatterND(x_f16, i, u_f16, reduction="add")      ->   x_float32 = Cast(x_f16); u_float32 = Cast(u_f16)
                                                              y = ScatterND(x_float32, i, u_float32) (fp32)
                                                              y_float16 = Cast(y)  -> y's readers

ONNX Runtime registers fp16 ScatterND/ScatterElements kernels that fail at run time for some reductions
(passes/onnx/spec.py lists them). convert() may rightly run them in fp16 for training in torch; the
exported model keeps every other decision and runs just these nodes in fp32. convert_onnx never needs
this pass: its painting keeps such nodes fp32 in the first place.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, cast_graph_output, make_cast, set_tensor_dtype
from amp_compiler.passes.onnx.spec import FLOAT_TYPES, input_role, is_float_value, low_precision_blocker
from amp_compiler.passes.runner import PassResult


def widen_refused_onnx_nodes(model: ir.Model) -> PassResult:
    names = UniqueNames(model)
    opset = model.opset_imports.get("", 1)
    widened = 0
    for node in list(all_nodes(model.graph)):
        low = _low_dtype_of(node)
        if low is None or low_precision_blocker(node, low, opset) is None:
            continue
        shared: dict[ir.Value, ir.Value] = {}
        for i, value in enumerate(node.inputs):
            if is_float_value(value) and value.dtype == low and input_role(node, i) == "data":
                if value not in shared:
                    shared[value] = make_cast(value, ir.DataType.FLOAT, names).outputs[0]
                node.replace_input_with(i, shared[value])
        for output in node.outputs:
            if is_float_value(output) and output.dtype == low:
                _read_back_in(output, low, names)
        widened += 1
    return PassResult(modified=widened > 0, counts={"refused_nodes_widened": widened})


def _low_dtype_of(node: ir.Node):
    dtypes = {v.dtype for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data"}
    low = dtypes & {t for t in FLOAT_TYPES if t != ir.DataType.FLOAT}
    return next(iter(low)) if len(low) == 1 else None


def _read_back_in(output: ir.Value, low: ir.DataType, names: UniqueNames) -> None:
    """`output` becomes fp32; whoever read it reads a cast back to `low`, graph outputs keep name and dtype."""
    uses = list(output.uses())
    set_tensor_dtype(output, ir.DataType.FLOAT)
    if uses:
        back = make_cast(output, low, names).outputs[0]
        for use in uses:
            use.node.replace_input_with(use.idx, back)
    graph = output.producer().graph
    for index, value in enumerate(list(graph.outputs)):
        if value is output:
            cast_graph_output(graph, index, low, names)
