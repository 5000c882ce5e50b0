"""The fx side of keep_norms_fp32 (passes/painting/keep_norms_fp32.py): each node's canonical op and the
nodes whose tensors it reads (Python numbers such as eps and the exponent left out). Returns the `painted`
hook of the decide step."""
from __future__ import annotations

from typing import Callable

import networkx as nx
import torch.fx as fx

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_norms_fp32 import keep_hand_written_norms_fp32


def keep_fx_hand_written_norms_fp32(gm: fx.GraphModule, norm_rule: str | None) -> Callable[[nx.DiGraph], None]:
    nodes = {n.name: n for n in gm.graph.nodes}

    def inputs(name: str) -> tuple[str, ...]:
        read: list = []
        fx.node.map_arg((nodes[name].args, nodes[name].kwargs), read.append)
        return tuple(n.name for n in read)

    return keep_hand_written_norms_fp32(lambda name: facts(nodes[name]).get("op"), inputs, norm_rule)
