"""Keep fp32 a norm written by hand, where the level keeps norms fp32 (a `painted` hook of the decide step,
decide.py, any IR): a hand-written norm is a norm.

    var = x.pow(2).mean(-1, keepdim=True)              # LlamaRMSNorm, T5LayerNorm, Gemma, Mistral, Mamba
    x = x * torch.rsqrt(var + eps)                     view nodes pow, mean, add, rsqrt, mul: low -> fp32 at O2,
                                                       rule "norm: a hand-written RMSNorm (pow -> mean -> ...)"
    u = x.mean(-1, keepdim=True); s = (x - u).pow(2).mean(-1, keepdim=True)   # a LayerNorm by hand: mean, sub too
    x = (x - u) / torch.sqrt(s + eps)
    x = g * (x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=eps))   # ScaleNorm: ||x|| at once

nn.LayerNorm and nn.RMSNorm are one op each, which the level keeps fp32 (O1 by the policy, O2 by
keep_batchnorm_fp32); written as pointwise ops, O2 would lower every one of them, and in fp16 the backward
of rsqrt (rsqrt(v)^3, 22-50 at init) overflows: every gradient of an fp16 O2 Llama is NaN. So the shape is
found on the painted view: a square (pow, square, x * x) whose mean, or a var/std, goes through + eps, a
root (sqrt, rsqrt) and 1/root to the mul or div that normalises the data; with a centring x - mean(x)
before it, a LayerNorm. Those nodes (not the affine weight and bias after them) follow the rule the level
gives rms_norm (a norm no kernel mixes): fp32 where it is deny, as decided where it is not (O3,
keep_batchnorm_fp32=False, allow_ops=["rms_norm"]). A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

import networkx as nx

from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.numerics import (NORM_CENTRING, NORM_MAGNITUDES, NORM_MEANS, NORM_NORMALISERS,
                                                NORM_ROOTS, NORM_SPREADS, NORM_SQUARES, NORM_STATISTIC_STEPS)

MAX_STATISTIC_STEPS = 4   # + eps, clamp, root, 1 / root: a longer chain is no norm's statistic


def hand_written_norms(view: nx.DiGraph, op: Callable[[Hashable], str | None],
                       inputs: Callable[[Hashable], Sequence[Hashable]]) -> dict[Hashable, tuple[str, list]]:
    """node -> (kind, the norm's nodes in order) for every node of a hand-written norm in `view` ("RMSNorm" or
    "LayerNorm"). `op(name)` is the canonical op of a view node, `inputs(name)` the names of the nodes whose
    tensors it reads (constants left out), in or out of the view."""
    found: dict[Hashable, tuple[str, list]] = {}
    starts = [[n, m] for n in view if _squares(n, op, inputs) for m in view.successors(n) if op(m) in NORM_MEANS]
    starts += [[n] for n in view if op(n) in NORM_SPREADS | NORM_MAGNITUDES]
    for members in starts:
        normaliser = _statistic_to_normaliser(view, members, op, inputs)
        if normaliser is None:
            continue
        members.append(normaliser)
        centring: list = []
        for data in (*inputs(members[0]), *inputs(normaliser)):   # x - x.mean(): the centring is the norm's too
            if data in view and op(data) in NORM_CENTRING:
                centre = [m for m in inputs(data)[1:] if m in view and op(m) in NORM_MEANS]
                if centre:
                    centring += [c for c in (*centre, data) if c not in centring and c not in members]
        kind = "LayerNorm" if centring or op(members[0]) in NORM_SPREADS else \
            "ScaleNorm" if op(members[0]) in NORM_MAGNITUDES else "RMSNorm"
        members[:0] = centring
        for node in members:
            found.setdefault(node, (kind, members))
    return found


def _squares(node, op, inputs) -> bool:
    """x.pow(2), x.square(), x * x."""
    read = inputs(node)
    return op(node) in NORM_SQUARES or (op(node) == "mul" and len(read) == 2 and read[0] == read[1])


def _statistic_to_normaliser(view, members: list, op, inputs):
    """Walk from the moment (members[-1]) through + eps, a root and 1/root to the mul/div that normalises the
    data with it; appends the steps to `members` and returns the normaliser, or None where the shape ends."""
    rooted = op(members[-1]) in ("std", *NORM_MAGNITUDES)
    for _ in range(MAX_STATISTIC_STEPS + 1):
        readers = list(view.successors(members[-1]))
        normalisers = [r for r in readers if rooted and op(r) in NORM_NORMALISERS and len(set(inputs(r))) == 2]
        if normalisers:
            return normalisers[0]
        steps = [r for r in readers if op(r) in NORM_ROOTS or
                 (op(r) in NORM_STATISTIC_STEPS and (op(r) != "div" or len(inputs(r)) == 1))]   # 1 / root, not x / root
        if len(steps) != 1:
            return None
        members.append(steps[0])
        rooted = rooted or op(steps[0]) in NORM_ROOTS
    return None


def keep_hand_written_norms_fp32(op: Callable[[Hashable], str | None],
                                 inputs: Callable[[Hashable], Sequence[Hashable]],
                                 norm_rule: str | None) -> Callable[[nx.DiGraph], None]:
    """The hook. norm_rule: why the level keeps norms fp32 (PrecisionRules.norm_kept_fp32), or None where it
    does not (the hook then leaves the painting as it is)."""
    def hook(view: nx.DiGraph) -> None:
        if norm_rule is None:
            return
        for node, (kind, members) in hand_written_norms(view, op, inputs).items():
            ops = [str(op(m)) for m in members]
            shape = " -> ".join(o for i, o in enumerate(ops) if i == 0 or o != ops[i - 1])
            keep_fp32(view, node, f"norm: a hand-written {kind} ({shape}, normalising at {members[-1]}), kept fp32 as "
                                  f"the level keeps norms ({norm_rule})", relabel_fp32=True)
    return hook
