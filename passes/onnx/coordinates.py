"""The ONNX side of keep_coordinates_fp32 (passes/painting/keep_coordinates_fp32.py): the main graph's nodes
(Range -> arange is the source), their canonical ops, and which readers take a value as their data (input
0, any input of Concat/Max/Min, Where's two branches) rather than as indices (Gather's), a shape or a
condition. Returns the `painted` hook of the decide step."""
from __future__ import annotations

from typing import Callable, Iterator

import networkx as nx
import onnx_ir as ir

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_coordinates_fp32 import keep_coordinates_fp32
from amp_compiler.passes.policy.numerics import EVERY_INPUT_IS_DATA


def readers_as_data(node: ir.Node) -> Iterator[tuple[ir.Node, bool]]:
    for value in node.outputs:
        for use in value.uses():
            op = facts(use.node).get("op")
            yield use.node, use.idx == 0 or op in EVERY_INPUT_IS_DATA or (op == "where" and use.idx in (1, 2))


def keep_onnx_coordinates_fp32(graph: ir.Graph) -> Callable[[nx.DiGraph], None]:
    return keep_coordinates_fp32(list(graph), lambda n: facts(n).get("op"), readers_as_data, lambda n: n.name)
