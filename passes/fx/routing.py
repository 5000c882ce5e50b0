"""Keep fp32 the scores a discrete choice is made from, and the buffers scattered results are added into
(a `painted` hook of the decide step, passes/painting/decide.py): mixture-of-experts routing.

    probs = softmax(router(h)); weights, chosen = topk(probs, 2)   # "softmax", "topk": fp32, rule "routing: ..."
    out = zeros_like(h); out.index_add_(0, token, expert_out)      # "zeros_like": fp32, rule "accumulator: ..."

A top-k (argmax, sort, kthvalue, max with indices) turns scores into indices: which expert runs, which box
is kept. Rounded to low precision, two close scores become one number or swap (bf16 keeps 8 bits: 0.2510
and 0.2515 are equal), and another expert runs: an error the size of the output, not of a rounding. So the
choice and the scores it reads, back through pointwise ops, data movement, softmax and dtype casts to the
op that computed them (the router's matmul, which runs low as autocast runs it), stay fp32 at every level.
An in-place scatter-add (index_add_, scatter_add_, scatter_reduce_, index_reduce_, index_put_ with
accumulate=True) adds into its first operand, and runs in that tensor's dtype: the buffer it was made as
(zeros_like) stays fp32, as the policy keeps the out-of-place scatter-adds (a low buffer rounds every
partial sum; its readers read the sum cast once). Counts of tokens per expert (histc) and an op that makes
integers of floats (the grouped experts' cumsum(counts, dtype=int32) offsets) stay fp32 too: bf16 holds
integers exactly only up to 256, and O2 lowers every op. A node the user forced, or another rule forced,
keeps its precision.
"""
from __future__ import annotations

import operator
from typing import Callable

import networkx as nx
import torch
import torch.fx as fx

from amp_compiler.passes.fx.aliases import written_views
from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.numerics import (COUNTS, FACTORIES_LIKE, ROUTING_INDICES_ONLY, ROUTING_SCORE_OPS,
                                                ROUTING_WITH_INDICES, SCATTER_ADDS)
from amp_compiler.passes.policy.op_policy import POLICY



def _uses_indices(node: fx.Node) -> bool:
    op = facts(node).get("op")
    if op in ROUTING_INDICES_ONLY:
        return True
    return op in ROUTING_WITH_INDICES and any(_part(user) == 1 and user.users for user in node.users)


def _part(user: fx.Node) -> int | None:
    """Which output of a (values, indices) pair `user` reads: out[1] or out.indices is 1."""
    if user.target is operator.getitem and len(user.args) > 1 and isinstance(user.args[1], int):
        return user.args[1]
    if user.target is getattr and len(user.args) > 1:
        return {"values": 0, "indices": 1}.get(user.args[1])
    return None


def _carries_scores(node: fx.Node) -> bool:
    """A node whose output orders like its inputs, or is computed from them pointwise: the walk from a
    choice back to the op that made its scores passes through it."""
    op = facts(node).get("op")
    rule = POLICY.get(op)
    if node.op not in ("call_function", "call_method", "call_module") or rule is None:
        return False
    if op in ROUTING_SCORE_OPS or rule.family == "user_cast":
        return True
    return rule.op_class in ("infer", "clear") and rule.family != "control_flow" and op not in FACTORIES_LIKE


def routing_scores(nodes) -> dict[fx.Node, fx.Node]:
    """node -> the choice it decides: every choice whose indices are used, and the nodes its float
    input comes from through _carries_scores nodes."""
    decided: dict[fx.Node, fx.Node] = {}
    for choice in nodes:
        if not _uses_indices(choice) or not choice.args or not isinstance(choice.args[0], fx.Node):
            continue
        decided.setdefault(choice, choice)
        decided.update((user, choice) for user in choice.users if _part(user) is not None)
        stack = [choice.args[0]]
        while stack:
            node = stack.pop()
            if node in decided or not is_float(facts(node).get("dtype")):
                continue
            if _carries_scores(node):
                decided[node] = choice
                stack.extend(node.all_input_nodes)
            elif _is_router(node, decided):
                decided[node] = choice
    return decided


def _is_router(node: fx.Node, decided) -> bool:
    """The matmul that computes the scores and nothing else (a router's linear): tokens x hidden x experts,
    a small share of the experts' own matmuls, so fp32 costs little and its rounding no longer picks."""
    rule = POLICY.get(facts(node).get("op"))
    return rule is not None and rule.family == "matmul" and all(
        user in decided or not (user.users or is_float(facts(user).get("dtype"))) for user in node.users)   # not asserts


def scatter_accumulators(nodes) -> dict[fx.Node, fx.Node]:
    """buffer -> the in-place scatter-add that adds into it (the base below the views it writes through)."""
    buffers = {}
    for node in nodes:
        op = facts(node).get("op")
        accumulates = op in SCATTER_ADDS or (op == "index_put" and _accumulate(node))
        if facts(node).get("inplace") and accumulates:
            chain = written_views(node)
            if chain:
                buffers.setdefault(chain[-1], node)
    return buffers


def _accumulate(node: fx.Node) -> bool:
    """index_put_(indices, values, accumulate): the fourth argument or the keyword."""
    return bool(node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False))


def keep_routing_fp32(gm: fx.GraphModule) -> Callable[[nx.DiGraph], None]:
    """The hook: routing scores and choices, and scatter-add buffers, run fp32 (module docstring)."""
    def hook(view: nx.DiGraph) -> None:
        nodes = list(gm.graph.nodes)    # after classification: written_views reads the families
        for node, choice in routing_scores(nodes).items():
            if node.name in view:
                what = "the choice" if node is choice else f"a score {choice.name} ({facts(choice)['op']}) chooses from"
                keep_fp32(view, node.name, f"routing: {what}: low precision ties or swaps close scores and "
                                            "another index is chosen (another expert runs), kept fp32",
                          relabel_fp32=True)
        for node in nodes:
            dtype = facts(node).get("dtype")   # integer out (complex rfft, unknown dtypes are no counts)
            makes_integers = facts(node).get("class") != "clear" and isinstance(dtype, torch.dtype) \
                and not (dtype.is_floating_point or dtype.is_complex)
            if node.name in view and (facts(node).get("op") in COUNTS or makes_integers):   # not a tuple's indices
                keep_fp32(view, node.name, "counts: tokens per expert (histc) or floats made integers (cumsum("
                                            "dtype=int32)): bf16 holds integers exactly only up to 256, kept fp32",
                          relabel_fp32=True)
        for buffer, writer in scatter_accumulators(nodes).items():
            if buffer.name in view:
                keep_fp32(view, buffer.name, f"accumulator: {writer.name} ({facts(writer)['op']}) adds into it in "
                                              "place, in its dtype: low precision rounds every partial sum, kept fp32",
                          relabel_fp32=True)
    return hook
