"""Give every node and value of an ONNX model a name no other node / value uses, subgraphs included.

    Relu (unnamed), Relu (unnamed), Add "a", Add "a"    ->    Relu, Relu_1, a, a_1

Precision decisions, reports and block lists refer to nodes by name, so names must identify nodes.
Graph inputs and outputs of the main graph keep their names (they are the model's interface); a name
already unique never changes, so a model that went through this pass once is left as it is.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.runner import PassResult


def unique_onnx_names(model: ir.Model) -> PassResult:
    interface = {v.name for v in (*model.graph.inputs, *model.graph.outputs) if v.name}
    seen_values: set[str] = set(interface)
    seen_nodes: set[str] = set()
    renamed = 0

    def claim(used: set[str], name: str | None, base: str) -> str | None:
        if name and name not in used:
            used.add(name)
            return None
        new, k = name or base, 0
        while new in used:
            k += 1
            new = f"{name or base}_{k}"
        used.add(new)
        return new

    for graph in model.graphs():
        values = [*graph.inputs, *graph.initializers.values()] if graph is not model.graph else \
            list(graph.initializers.values())
        for node in graph:
            values.extend(node.outputs)
        for value in values:
            if value.name in interface and (value.is_graph_input() or value.is_graph_output()) \
                    and value.graph is model.graph:
                continue
            new = claim(seen_values, value.name, "value")
            if new is not None:
                value.name = new
                renamed += 1
        for node in graph:
            new = claim(seen_nodes, node.name, node.op_type)
            if new is not None:
                node.name = new
                renamed += 1
    return PassResult(modified=renamed > 0, counts={"names_made_unique": renamed})
