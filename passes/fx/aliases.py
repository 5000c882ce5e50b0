"""Alias analysis on fx graphs: what an in-place op writes, and the views it writes through.

    v = h[:, :4]; v.mul_(2)      written_value(mul_) -> v;  written_views(mul_) -> [v, h]
A write through a view changes its base, so a pass that casts a value (insert_casts), folds casts of it
(fold_casts), or paints the views between a write and its base (decide_precision, routing, place_casts)
reads these. Reads facts(node)["inplace"] (canonicalize) and ["family"] (decide_precision's classification).
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.node_facts import facts


def written_value(node: fx.Node) -> fx.Node | None:
    """The value an in-place op writes (its first argument), else None."""
    if facts(node).get("inplace") and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def written_views(node: fx.Node) -> list[fx.Node]:
    """What an in-place op writes through: its first argument and, while that is a view-like op (the
    policy's "shape" family: getitem, view, transpose...), the values below it, the base last. Conservative:
    a reshape that copies is treated as a view."""
    chain, value = [], written_value(node)
    while isinstance(value, fx.Node) and value not in chain:
        chain.append(value)
        if facts(value).get("family") != "shape" or not value.args or not isinstance(value.args[0], fx.Node):
            break
        value = value.args[0]
    return chain
