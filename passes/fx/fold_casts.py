"""Clean up casts: fold chains, drop no-ops, merge duplicates, remove dead ones.

    amp_cast(amp_cast(x_fp32, f16), f32)  ->  x_fp32      (reuse the exact value, no round trip)
    amp_cast(x_f16, f16)                  ->  x_f16
    two amp_cast(x, f16)                  ->  one
Casts written by the user (x.float(), x.to(...)) are never touched: they are the model's semantics.
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.fx.aliases import written_views
from amp_compiler.passes.fx.runtime import is_cast
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts


def fold_casts(gm: fx.GraphModule) -> PassResult:
    graph, removed = gm.graph, 0
    seen: dict[tuple[fx.Node, object, int], fx.Node] = {}
    writes: dict[fx.Node, int] = {}  # a cast made before an in-place write is not a duplicate of one after
    for node in list(graph.nodes):
        for written in written_views(node):   # a write through a view (attn[:, :, 1:] = ...) changes its base too
            writes[written] = writes.get(written, 0) + 1
        if not is_cast(node):
            continue
        source, dtype = node.args
        while is_cast(source):           # a cast of a cast reads the first cast's source
            source = source.args[0]
        if source is not node.args[0]:
            node.args = (source, dtype)
        source_dtype = facts(source).get("dtype")
        key = (source, dtype, writes.get(source, 0))
        replacement = source if source_dtype == dtype else seen.get(key)
        if replacement is not None:
            node.replace_all_uses_with(replacement)
        else:
            seen[key] = node
    for node in reversed(list(graph.nodes)):
        if is_cast(node) and not node.users:
            graph.erase_node(node)
            removed += 1
    return PassResult(modified=removed > 0, counts={"casts_removed": removed})


def count_casts(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_cast(n))
