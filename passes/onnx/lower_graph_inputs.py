"""With keep_io_types=False, let a float graph input arrive in low precision when nothing reads it in fp32.

    x: float32 -> x_float16 = Cast(x, FLOAT16) -> MatMul(x_float16, w)      ->      x: float16 -> MatMul(x, w)

An input read in two precisions stays as it is (one reader would need a cast back up). The input keeps
its name; the casts go. The same rule serves exported models, whose graph inputs keep the example
inputs' dtype, and converted ones.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.cast_nodes import cast_target, is_cast, set_tensor_dtype
from amp_compiler.passes.onnx.spec import is_float_value
from amp_compiler.passes.runner import PassResult


def lower_onnx_graph_inputs(model: ir.Model, low: ir.DataType) -> PassResult:
    lowered = 0
    for value in model.graph.inputs:
        if not is_float_value(value) or value.dtype == low or value.is_initializer():
            continue
        readers = [use.node for use in value.uses()]
        if not readers or value.is_graph_output() or not all(
                is_cast(r) and cast_target(r) == low and not r.outputs[0].is_graph_output() for r in readers):
            continue
        set_tensor_dtype(value, low)
        for cast in dict.fromkeys(readers):
            cast.outputs[0].replace_all_uses_with(value)
            cast.graph.remove(cast, safe=True)
        lowered += 1
    return PassResult(modified=lowered > 0, counts={"graph_inputs_lowered": lowered})
