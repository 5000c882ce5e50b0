"""A converted graph's decisions, kept through torch.save / torch.load.

torch.save keeps a GraphModule's code, not its nodes: torch.load re-traces the code into fresh nodes
with empty meta. `preserve_decisions(gm)` (convert() calls it last) stores every node's facts and the
conversion summary as a plain attribute, which pickling keeps; `graph_summary(gm)` puts them back on the
re-traced nodes (same code, so same node order) and returns gm.meta["amp"].
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.node_facts import ROLE, facts

SAVED_ATTRIBUTE = "_amp_saved_decisions"
NOT_CONVERTED = "needs a GraphModule returned by amp_compiler.convert()"


def graph_summary(gm) -> dict:
    """gm.meta["amp"], put back from the saved copy on a module that went through torch.save/load."""
    meta = getattr(gm, "meta", None) or {}
    if "amp" in meta:
        return meta["amp"]
    saved = getattr(gm, SAVED_ATTRIBUTE, None)
    if saved is None or not isinstance(gm, fx.GraphModule):
        raise ValueError(f"{type(gm).__name__}: {NOT_CONVERTED} (or one saved after "
                         "amp_compiler.saved_decisions.preserve_decisions)")
    nodes = list(gm.graph.nodes)
    if [node.op for node in nodes] != [op for op, _, _ in saved["nodes"]]:
        raise ValueError("the saved precision decisions do not match this graph: it was edited after "
                         "convert(); convert the model again")
    for node, (_, amp, role) in zip(nodes, saved["nodes"]):
        node.meta["amp"] = amp
        if role is not None:
            node.meta[ROLE] = role
    gm.meta = {**meta, "amp": saved["summary"]}
    return gm.meta["amp"]


def preserve_decisions(gm: fx.GraphModule) -> None:
    """Keep the record through torch.save/torch.load (call it last: later graph edits are not tracked)."""
    nodes = [(node.op, facts(node), node.meta.get(ROLE)) for node in gm.graph.nodes]
    setattr(gm, SAVED_ATTRIBUTE, {"summary": gm.meta["amp"], "nodes": nodes})
