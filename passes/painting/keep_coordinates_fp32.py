"""Keep fp32 the coordinates a model computes from a grid of positions, and the ops that read them (a
`painted` hook of the decide step, decide.py, any IR).

    coords = meshgrid(arange(h), arange(w)).float()        # RAFT: a position per pixel, 0..h-1
    for _ in range(12): coords = coords + delta_flow        # view node "add_17": low -> fp32, rule "coordinates: ..."
    grid_sample(corr, 2 * coords / (w - 1) - 1)              # the sampling grid: fp32 all the way from arange

A position carries its magnitude on to every translation of it: bf16 holds 128 in steps of 0.5 (fp16 in
steps of 0.06 from 64), so a small update added to it in low precision is rounded away, `coords1 - coords0`
cancels to the rounding error, and a sampler reads a neighbour. autocast keeps them fp32 because arange's
fp32 result promotes every add it meets; the painting would paint those adds low (between two convs).
So a value computed from an arange/linspace through arithmetic (add, sub, mul, div, clamp...), data
movement and dtype casts is a coordinate, kept fp32 at every level, and so is a pointwise op that reads
one (sin of positions x frequencies: its argument must not be rounded first) or samples at them (grid_sample:
its grid and its input share one dtype, so it runs fp32 even at O2). A matmul or conv that reads coordinates
still runs low (what it reads is small: a flow, a normalised offset). A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import networkx as nx

from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.numerics import COORDINATE_SAMPLERS, COORDINATE_SOURCES, FACTORIES_LIKE
from amp_compiler.passes.policy.op_policy import POLICY

READERS_KEPT_FP32 = ("infer", "deny")   # by the op policy's class, whatever the level made of it


def carries_position(op: str | None, as_data: bool = True) -> bool:
    """Whether an op's output is still a position when an input is one: pointwise arithmetic (translate,
    scale, subtract two positions), dtype casts, and data movement or selection (clamp, where, round) of
    the positions as data: not `x[arange(n)]` or gather(x, 0, idx), which read them as indices."""
    rule = POLICY.get(op)
    if rule is None or op in FACTORIES_LIKE:     # unknown ops; a tensor shaped like the positions, not computed from them
        return False
    if rule.family in ("arithmetic", "user_cast"):
        return True
    return as_data and rule.op_class == "clear" and rule.family != "control_flow"


def coordinates(nodes: Iterable[Hashable], op: Callable[[Hashable], str | None],
                readers: Callable[[Hashable], Iterable[tuple[Hashable, bool]]]) -> tuple[dict, dict]:
    """(coordinate -> the arange/linspace it comes from, reader -> the coordinate it reads): every node
    reached from a source through ops that carry a position (carries_position), and the first readers
    past them that compute from them (policy class infer or deny). `op(node)` is the node's canonical op,
    `readers(node)` its readers, each with whether it reads the node as its data (not as indices, a mask,
    a shape); nodes are any IR's node names or objects."""
    source_of, read = {}, {}
    stack = [n for n in nodes if op(n) in COORDINATE_SOURCES]
    source_of.update((n, n) for n in stack)
    while stack:
        node = stack.pop()
        for reader, as_data in readers(node):
            if reader in source_of:
                continue
            if carries_position(op(reader), as_data):
                source_of[reader] = source_of[node]
                stack.append(reader)
            elif (as_data or op(reader) in COORDINATE_SAMPLERS) and \
                    getattr(POLICY.get(op(reader)), "op_class", None) in READERS_KEPT_FP32:
                read.setdefault(reader, node)
    read = {reader: value for reader, value in read.items() if reader not in source_of}
    return source_of, read


def keep_coordinates_fp32(nodes: Iterable[Hashable], op: Callable[[Hashable], str | None],
                          readers: Callable[[Hashable], Iterable[tuple[Hashable, bool]]],
                          name: Callable[[Hashable], str] = str) -> Callable[[nx.DiGraph], None]:
    """The hook, for one IR's nodes (see coordinates()): the coordinates in the view run fp32, and so do
    the ops that compute from them; `name(node)` is the node's name in the view."""
    source_of, read = coordinates(nodes, op, readers)
    source_of = {name(n): name(source) for n, source in source_of.items()}
    read = {name(n): name(coordinate) for n, coordinate in read.items()}

    def hook(view: nx.DiGraph) -> None:
        for node, source in source_of.items():
            if node in view:
                keep_fp32(view, node, f"coordinates: a position computed from {source} (arange/linspace) by "
                                       "arithmetic and data movement: low precision rounds it (bf16: steps of 0.5 "
                                       "at 128), small updates vanish, kept fp32", relabel_fp32=True)
        for node, coordinate in read.items():
            if node in view:
                keep_fp32(view, node, f"{view.nodes[node]['op_class']}: reads the coordinates {coordinate}: a "
                                       "position rounded to low precision first would be off by its rounding, kept fp32",
                          relabel_fp32=True)
    return hook
