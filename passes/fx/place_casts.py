"""Cast placement on fx: the ValueFlow of a graph (bytes from each node's fake value, meta["val"]) for the
IR-neutral placement hook of painting/place_casts.py.

    decide_fx_precision(gm, rules, painted=(FxCastPlacement(gm, rules, keep_io_types=True),))
    pass counts += bytes_cast_before, bytes_cast_after, nodes_moved

Bytes are each value's fp32 size. Inputs and weights hold their dtype; the graph's output wants the dtype
the model returned (keep_io_types); ignored readers (user casts, opaque calls, in-place ops) take a value
as it comes; a mixed-kernel norm reads its weights fp32 in either precision, so they are never cast for
it; an fp32 add/sub/mul/div whose other operand is a painted-fp32 tensor reads a low value as it comes
(promote_in_kernel drops that cast: the kernel upcasts as it reads). A graph without fake values is left as
painted.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from amp_compiler.passes.fx.aliases import written_value
from amp_compiler.passes.fx.insert_casts import keeps_its_dtype, reads_as_norm_weight
from amp_compiler.passes.fx.promote_in_kernel import promotion_partner
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.place_casts import FP32, LOW, CastPlacement, ValueFlow
from amp_compiler.passes.policy.rules import PrecisionRules

OUTPUT = "output"


def fp32_bytes(node: fx.Node) -> int | None:
    """The fp32 size of a node's single float tensor value, None when it has several, none or no size hint."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    numel = value.numel()
    if isinstance(numel, torch.SymInt):
        if not numel.node.has_hint():
            return None
        numel = numel.node.hint   # the example inputs' size
    return int(numel) * 4


class FxCastPlacement:
    """A `painted` hook: builds the graph's ValueFlow once painting has classified it, then places casts."""

    def __init__(self, gm: fx.GraphModule, rules: PrecisionRules, keep_io_types: bool, method: str = "cut"):
        self.gm, self.rules, self.keep_io_types, self.counts = gm, rules, keep_io_types, {}
        self.method = method   # or "greedy": the local search the benchmark compares the cut with

    def __call__(self, view) -> None:
        if not any("val" in node.meta for node in self.gm.graph.nodes):
            return   # no fake values, no sizes: painting stands
        placement = CastPlacement(self.value_flow(view), self.method)
        placement(view)
        self.counts = placement.counts

    def value_flow(self, view) -> ValueFlow:
        low = self.rules.low_dtype
        sides = {torch.float32: FP32, getattr(torch, low): LOW}
        flow = ValueFlow(value_bytes={}, readers={}, fixed={OUTPUT: FP32})
        written: dict[fx.Node, fx.Node] = {}   # an in-place op's value is the tensor it writes, in its dtype
        for node in self.gm.graph.nodes:
            target = written_value(node) if node.name not in view else None
            if target is not None:
                written[node] = written.get(target, target)
        for node in self.gm.graph.nodes:
            dtype = facts(node).get("dtype")
            size = fp32_bytes(node)
            if node in written:
                continue   # its readers read the written tensor (below)
            if node.name not in view:
                if node.op == "output" or dtype not in sides:
                    continue
                flow.fixed[node.name] = sides[dtype]   # an input, a weight, an ignored op's value
            if dtype not in sides or size is None:
                continue
            flow.value_bytes[node.name] = size
            flow.readers[node.name] = []
        for node in self.gm.graph.nodes:
            producer = written.get(node, node)
            if producer.name not in flow.readers:
                continue
            readers = flow.readers[producer.name]
            for user in node.users:
                if user.name in view and not self._weight_read_fp32(node, user) and user.name not in readers \
                        and not _promotes_in_kernel(node, user, view):
                    readers.append(user.name)
                elif user.op == "output" and self.keep_io_types and facts(producer).get("dtype") == torch.float32 \
                        and not (keeps_its_dtype(node) or keeps_its_dtype(producer)):
                    readers.append(OUTPUT)
        pinned = _written_through_views(written.values())
        for node in self.gm.graph.nodes:
            inputs = [written.get(a, a) for a in node.all_input_nodes]
            sized = all(a.name in flow.value_bytes or facts(a).get("dtype") not in sides for a in inputs)
            if node.name in view and node.name in flow.value_bytes and sized and node not in pinned \
                    and not _names_a_dtype(node):
                flow.movable.add(node.name)
        return flow

    def _weight_read_fp32(self, value: fx.Node, reader: fx.Node) -> bool:
        return reads_as_norm_weight(reader, value) and self.rules.keeps_fp32_weights(facts(reader).get("op"))


def _promotes_in_kernel(value: fx.Node, reader: fx.Node, view) -> bool:
    """An fp32 add/sub/mul/div reading `value` beside a dimensioned fp32 tensor: in either precision of
    `value` no cast is made for it (promote_in_kernel), so placement gains nothing by moving it for this reader."""
    other = promotion_partner(reader, value) if view.nodes[reader.name]["precision"] == FP32 else None
    if other is None:
        return False
    if other.name in view:
        return view.nodes[other.name]["precision"] == FP32
    return facts(other).get("dtype") == torch.float32


def _names_a_dtype(node: fx.Node) -> bool:
    """zeros_like(x, dtype=torch.float32): the value's dtype is the argument's, whatever the node's precision."""
    leaves: list = []
    fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
    return any(isinstance(value, torch.dtype) for value in leaves)


def _written_through_views(targets) -> set[fx.Node]:
    """x[:, 0].add_(1) writes x through a view: the view and what it views must keep one precision (a cast
    between them would take the write on a copy), so none of them moves."""
    pinned: set[fx.Node] = set()
    for node in targets:
        while facts(node).get("family") == "shape" and node not in pinned:
            pinned.add(node)
            base = node.args[0] if node.args else None
            if not isinstance(base, fx.Node):
                break
            pinned.add(base)
            node = base
    return pinned
