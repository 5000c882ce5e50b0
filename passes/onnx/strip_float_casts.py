"""Remove the model's float->float Casts, so that painting decides every precision boundary afresh.

    y = Cast(x_f32, to=FLOAT16); z = MatMul(y, w)      ->      z = MatMul(x_f32, w)
    (insert_onnx_casts puts back what the painting needs; converting a converted model re-creates its casts)

First it records what the source model computes: for every node the dtypes it read (node.meta
["source_input_dtypes"]) and for every graph its output dtypes (graph.meta["source_output_dtypes"]).
Unpainted nodes and keep_io_types restore exactly those. Casts from or to non-float types (int, bool,
fp64) are the model's semantics and stay; so does a Cast whose output is a graph output that its input
cannot stand in for.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.cast_nodes import bypass_cast, cast_target, is_cast
from amp_compiler.passes.onnx.spec import is_float_type, is_float_value, tensor_dtype
from amp_compiler.passes.runner import PassResult


def record_source_dtypes(model: ir.Model) -> None:
    for graph in model.graphs():
        graph.meta["source_output_dtypes"] = tuple(tensor_dtype(v) for v in graph.outputs)
        for node in graph:
            node.meta["source_input_dtypes"] = tuple(tensor_dtype(v) for v in node.inputs)


def strip_onnx_float_casts(model: ir.Model) -> PassResult:
    record_source_dtypes(model)
    removed = kept = 0
    for graph in list(model.graphs()):
        for node in list(graph):
            if is_cast(node) and is_float_value(node.inputs[0]) and is_float_type(cast_target(node)):
                if bypass_cast(node):
                    removed += 1
                else:
                    kept += 1
    return PassResult(modified=removed > 0,
                      counts={"source_float_casts_removed": removed, "source_float_casts_kept": kept})
