"""How the ONNX passes build, name, place and remove Cast nodes in an onnx_ir graph.

    make_cast(x, FLOAT16)                    ->  x_float16 = Cast(x, to=FLOAT16), placed right after x's producer
    cast_graph_output(graph, 0, FLOAT)       ->  logits_float16 = MatMul(...); logits = Cast(logits_float16)
    bypass_cast(Cast(x) -> y)                ->  y's readers read x (a graph output y: x takes the name y)

Names are unique across the model (subgraphs included) and derived from the value they cast, so converting
twice produces the same names: casts are removed and re-created, never renamed with a counter that grows.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.spec import FLOAT_TYPES, input_role, is_float_value
from amp_compiler.passes.policy.numerics import dtype_name


def is_cast(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type == "Cast"


def cast_target(node: ir.Node) -> ir.DataType:
    return ir.DataType(node.attributes["to"].as_int())


def set_tensor_dtype(value: ir.Value, dtype: ir.DataType) -> None:
    # A fresh TensorType: type objects may be shared between values, so never mutate one in place.
    value.type = ir.TensorType(dtype)


class UniqueNames:
    """Value names and node names in use anywhere in a model (ONNX keeps the two apart); hands out new ones."""

    def __init__(self, model: ir.Model):
        self.values: set[str] = set()
        self.nodes: set[str] = set()
        for graph in model.graphs():
            self.values.update(v.name for v in (*graph.inputs, *graph.initializers.values()) if v.name)
            for node in graph:
                if node.name:
                    self.nodes.add(node.name)
                self.values.update(v.name for v in node.outputs if v.name)

    def value(self, base: str) -> str:
        return _fresh(self.values, base)

    def node(self, base: str) -> str:
        return _fresh(self.nodes, base)


def _fresh(used: set[str], base: str) -> str:
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def make_cast(value: ir.Value, dtype: ir.DataType, names: UniqueNames, *, output_name: str | None = None) -> ir.Node:
    """A Cast of `value` to `dtype`, inserted where `value` becomes available (after its producer, or first
    in the graph that owns a graph input / initializer)."""
    name = output_name or names.value(f"{value.name}_{dtype_name(dtype)}")
    output = ir.Value(name=name, type=ir.TensorType(dtype),
                      shape=value.shape.copy() if value.shape is not None else None)
    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", dtype.value)], outputs=[output],
                   name=names.node(name))
    producer = value.producer()
    if producer is not None:
        producer.graph.insert_after(producer, cast)
    else:
        graph = value.graph
        if len(graph):
            graph.insert_before(graph[0], cast)
        else:
            graph.append(cast)
    return cast


def cast_graph_output(graph: ir.Graph, index: int, dtype: ir.DataType, names: UniqueNames) -> ir.Node:
    """Make output `index` of `graph` a Cast to `dtype`; the output keeps its name (the model's interface)."""
    output = graph.outputs[index]
    producer = output.producer()
    if producer is not None and producer.graph is graph and list(graph.outputs).count(output) == 1:
        name = output.name
        output.name = names.value(f"{name}_{dtype_name(output.dtype)}")
        cast = make_cast(output, dtype, names, output_name=name)
    else:   # a graph input or an outer value passed straight through: cast at the end of this graph
        cast_output = ir.Value(name=names.value(f"{output.name}_{dtype_name(dtype)}"), type=ir.TensorType(dtype),
                               shape=output.shape.copy() if output.shape is not None else None)
        cast = ir.Node("", "Cast", [output], [ir.AttrInt64("to", dtype.value)], outputs=[cast_output],
                       name=names.node(cast_output.name))
        graph.append(cast)
    graph.outputs[index] = cast.outputs[0]
    return cast


def bypass_cast(cast: ir.Node) -> bool:
    """Remove `cast`, its readers reading its input instead. False (nothing changed) when its output is a
    graph output that the input cannot stand in for (a graph input, an outer value, another output)."""
    source, output, graph = cast.inputs[0], cast.outputs[0], cast.graph
    if output.is_graph_output():
        producer = source.producer()
        if producer is None or producer.graph is not graph or source.is_graph_output() or \
                list(graph.outputs).count(output) != 1:
            return False
        name = output.name
        output.replace_all_uses_with(source, replace_graph_outputs=True)
        graph.remove(cast, safe=True)
        output.name = None
        source.name = name
        return True
    output.replace_all_uses_with(source)
    graph.remove(cast, safe=True)
    return True


def run_fp32_between_casts(node: ir.Node, low: ir.DataType, names: UniqueNames) -> None:
    """`node` reads fp32 copies of its low data inputs and writes fp32; its readers read a Cast back to `low`."""
    shared: dict[ir.Value, ir.Value] = {}
    for i, value in enumerate(node.inputs):
        if is_float_value(value) and value.dtype == low and input_role(node, i) == "data":
            if value not in shared:
                shared[value] = make_cast(value, ir.DataType.FLOAT, names).outputs[0]
            node.replace_input_with(i, shared[value])
    for output in node.outputs:
        if not (is_float_value(output) and output.dtype == low):
            continue
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


def low_data_dtype(node: ir.Node, *, only_low: bool) -> ir.DataType | None:
    """The one low float dtype among `node`'s data inputs, else None; with `only_low`, also None when an
    fp32 data input sits beside it."""
    dtypes = {v.dtype for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data"}
    low = dtypes & {t for t in FLOAT_TYPES if t != ir.DataType.FLOAT}
    if len(low) != 1 or (only_low and len(dtypes) != 1):
        return None
    return next(iter(low))
