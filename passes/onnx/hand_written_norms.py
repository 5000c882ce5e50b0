"""The ONNX side of keep_norms_fp32 (passes/painting/keep_norms_fp32.py): the graph's nodes by name, their
canonical ops and the nodes whose tensors they read, constants left out (Pow's exponent, the eps of Add, the
1 of Div(1, Sqrt) are initializers or Constant nodes). torch.onnx writes rsqrt as Sqrt -> Reciprocal, which
the walk takes as a root and 1/root. Returns the `painted` hook of the decide step."""
from __future__ import annotations

from typing import Callable

import networkx as nx
import onnx_ir as ir

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.spec import is_onnx_op
from amp_compiler.passes.painting.keep_norms_fp32 import keep_hand_written_norms_fp32


def _computed(value: ir.Value | None) -> ir.Node | None:
    producer = value.producer() if value is not None else None
    return None if producer is None or is_onnx_op(producer, "Constant") else producer


def keep_onnx_hand_written_norms_fp32(graph: ir.Graph, norm_rule: str | None) -> Callable[[nx.DiGraph], None]:
    nodes = {n.name: n for n in all_nodes(graph)}

    def inputs(name: str) -> tuple[str, ...]:
        return tuple(p.name for p in map(_computed, nodes[name].inputs) if p is not None)

    return keep_hand_written_norms_fp32(lambda name: facts(nodes[name]).get("op"), inputs, norm_rule)
