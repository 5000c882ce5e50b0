"""The fx side of keep_coordinates_fp32 (passes/painting/keep_coordinates_fp32.py): the graph's nodes, their
canonical ops, and which readers take a value as their data (x, or an entry of cat's list) rather than as
indices (`x[arange(n)]`, gather(x, 0, idx)). Returns the `painted` hook of the decide step."""
from __future__ import annotations

from typing import Callable, Iterator

import networkx as nx
import torch.fx as fx

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_coordinates_fp32 import keep_coordinates_fp32


def readers_as_data(node: fx.Node) -> Iterator[tuple[fx.Node, bool]]:
    for reader in node.users:
        data = reader.args[0] if reader.args else None
        yield reader, data is node or (isinstance(data, (list, tuple)) and node in data) or \
            (facts(reader).get("op") == "where" and node in reader.args[1:])


def keep_fx_coordinates_fp32(gm: fx.GraphModule) -> Callable[[nx.DiGraph], None]:
    return keep_coordinates_fp32(gm.graph.nodes, lambda n: facts(n).get("op"), readers_as_data, lambda n: n.name)
