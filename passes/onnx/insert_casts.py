"""Rewrite an ONNX model to the painted precisions: one Cast per (value, dtype), shared by every reader.

    y = MatMul(x, w)            ->   x_float16 = Cast(x); w_float16 = Cast(w)     (w: folded into an fp16
                                     y = MatMul(x_float16, w_float16)              initializer by fold_onnx_casts)

Walks every graph in order, a subgraph before the node that owns it, keeping each value's type equal to
the dtype it will have after the rewrite:
  - a painted node reads its float data inputs in its precision; its float outputs take that precision
    (LayerNormalization's Mean/InvStdDev keep their stash_type); spec-fixed inputs (Resize roi/scales,
    Dropout ratio) keep their dtype; RandomNormalLike/RandomUniformLike get dtype=precision;
  - an unpainted node reads exactly the dtypes it read in the source model, so its outputs do not change
    (Shape, comparisons, ArgMax... read any float type as long as their float inputs agree);
  - If branches end in the If's precision; Loop/Scan bodies end in their source dtypes;
  - with keep_io_types the main graph's outputs keep their source dtypes (and names).
Reads facts(node)["precision"], node.meta["source_input_dtypes"], graph.meta["source_output_dtypes"].
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.cast_nodes import UniqueNames, cast_graph_output, make_cast, set_tensor_dtype
from amp_compiler.passes.onnx.spec import (DTYPE_ATTRIBUTE_FOLLOWS_PRECISION, READS_ANY_FLOAT, follows_precision,
                                     input_role, is_float_type, is_float_value, is_onnx_op, subgraphs_of,
                                     tensor_dtype)
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts


def insert_onnx_casts(model: ir.Model, low: ir.DataType, keep_io_types: bool = True) -> PassResult:
    rewrite = _Rewrite(low, UniqueNames(model))
    graph = model.graph
    sources = graph.meta.get("source_output_dtypes") or tuple(tensor_dtype(v) for v in graph.outputs)
    rewrite.graph(graph, output_wants=sources if keep_io_types else (None,) * len(graph.outputs))
    return PassResult(modified=rewrite.casts > 0 or rewrite.attributes > 0,
                      counts={"casts_inserted": rewrite.casts, "dtype_attributes_set": rewrite.attributes})


class _Rewrite:
    def __init__(self, low: ir.DataType, names: UniqueNames):
        self.low, self.names = low, names
        self.shared: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
        self.casts = self.attributes = 0

    def graph(self, graph: ir.Graph, output_wants) -> None:
        for node in list(graph):   # a snapshot: casts are inserted while walking
            for subgraph in subgraphs_of(node):
                self.graph(subgraph, self._subgraph_output_wants(node, subgraph))
            self.node(node)
        for index, want in enumerate(output_wants):
            output = graph.outputs[index]
            if want is not None and is_float_value(output) and output.dtype != want:
                cast_graph_output(graph, index, want, self.names)
                self.casts += 1

    def node(self, node: ir.Node) -> None:
        precision = self._precision(node)
        source = node.meta.get("source_input_dtypes") or tuple(tensor_dtype(v) for v in node.inputs)
        if precision is None:
            floats = [i for i, v in enumerate(node.inputs) if is_float_value(v)]
            if is_onnx_op(node, *READS_ANY_FLOAT) and len({node.inputs[i].dtype for i in floats}) <= 1:
                return
            for i in floats:
                self.read_as(node, i, source[i])
            return
        for i, value in enumerate(node.inputs):
            if is_float_value(value):
                self.read_as(node, i, precision if input_role(node, i) == "data" else source[i])
        attribute = DTYPE_ATTRIBUTE_FOLLOWS_PRECISION.get(node.op_type)
        if attribute is not None and is_onnx_op(node, node.op_type) and attribute in node.attributes:
            node.attributes[attribute] = ir.AttrInt64(attribute, precision.value)
            self.attributes += 1
        for j, output in enumerate(node.outputs):
            if is_float_value(output) and follows_precision(node, j):
                set_tensor_dtype(output, precision)

    def read_as(self, node: ir.Node, index: int, want) -> None:
        value = node.inputs[index]
        if want is None or not is_float_type(want) or value.dtype == want:
            return
        key = (value, want)
        if key not in self.shared:
            self.shared[key] = make_cast(value, want, self.names).outputs[0]
            self.casts += 1
        node.replace_input_with(index, self.shared[key])

    def _precision(self, node: ir.Node):
        precision = facts(node).get("precision")
        return None if precision is None else self.low if precision == "low" else ir.DataType.FLOAT

    def _subgraph_output_wants(self, node: ir.Node, subgraph: ir.Graph):
        sources = subgraph.meta.get("source_output_dtypes") or tuple(tensor_dtype(v) for v in subgraph.outputs)
        precision = self._precision(node)
        if is_onnx_op(node, "If") and precision is not None:
            return tuple(precision if is_float_type(d) else None for d in sources)
        return sources
