"""IR version < 4: every initializer is also a graph input, so the initializers the rewrite added are declared.

    (IR 3)  inputs: x, w, b; initializers: w, b, b_float16    ->    inputs: x, w, b, b_float16

ONNX IR 3 reads an initializer as the default value of a graph input of the same name; onnx.checker
rejects an initializer without one ("b_float16 in initializer but not in graph input"). From IR 4 on an
initializer stands alone, and declaring it an input would make it overridable, so newer models are left as
they are. Every graph (subgraphs too) is handled, as the checker checks each.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.runner import PassResult

FIRST_IR_WITHOUT_INITIALIZER_INPUTS = 4


def declare_initializer_inputs(model: ir.Model) -> PassResult:
    if model.ir_version >= FIRST_IR_WITHOUT_INITIALIZER_INPUTS:
        return PassResult(modified=False)
    declared = 0
    for graph in model.graphs():
        inputs = set(graph.inputs)
        for value in graph.initializers.values():
            if value not in inputs:
                graph.inputs.append(value)
                declared += 1
    return PassResult(modified=declared > 0, counts={"initializers_declared_as_inputs": declared})
