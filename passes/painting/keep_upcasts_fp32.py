"""Honour an upcast the model writes: the ops computing on it stay fp32 up to the model's cast back (a
`painted` hook of the decide step, decide.py, any IR).

    hidden_states = hidden_states.to(torch.float32)               # LlamaRMSNorm; the view node "pow_1" and the
    variance = hidden_states.pow(2).mean(-1, keepdim=True)         # rest: low -> fp32 at O2, rule "upcast: the
    hidden_states = hidden_states * torch.rsqrt(variance + eps)    # model's own .to(float32) at to_6 ..."
    return self.weight * hidden_states.to(input_dtype)             # the cast back: the walk ends there

A cast is never undone (the front ends keep it: its class is ignore), but O2 paints every op low, so before
this hook the painting cast the upcast value straight back to fp16 for the pow that follows, and the fp16
backward of rsqrt overflowed. autocast and Apex O2 both run what computes on an explicit upcast in fp32
(autocast's fp32-input rule; Apex never rewrites the user's cast). So from each upcast (the adapter says
which casts are the model's own to float32 of a float value), the walk takes every reader that is not a
matmul-class op (the policy's allow class, which runs low on fp32 inputs under autocast too) and not
outside the painting, until another cast of the model's: that one is the cast back (captured at fp32 it is
a .to(float32) too; it starts no walk of its own). The walk stays inside the module that wrote the cast
(its children included): torch.export reads a no-op cast's output where the source read its input (the
decoder layer's residual add reads LlamaRMSNorm's upcast), and the residual stream is not the norm's.
A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import networkx as nx

from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.op_policy import POLICY

STOPS = ("allow", "ignore")   # matmul-class ops run low on an fp32 input (autocast too); ignore: not painted


def upcast_regions(upcasts: Iterable[Hashable], readers: Callable[[Hashable], Iterable[Hashable]],
                   op: Callable[[Hashable], str | None], is_cast: Callable[[Hashable], bool],
                   module: Callable[[Hashable], str]) -> dict[Hashable, Hashable]:
    """node -> the upcast it computes on. `upcasts` in graph order; `readers(node)` the nodes that read it;
    `is_cast(node)`: a cast of the model's (any dtype), which ends a walk; `module(node)`: its module path."""
    region: dict[Hashable, Hashable] = {}
    cast_backs: set = set()
    for upcast in upcasts:
        if upcast in cast_backs:
            continue
        scope = module(upcast)
        stack = [upcast]
        while stack:
            for reader in readers(stack.pop()):
                if reader in region or reader in cast_backs or reader == upcast or not _inside(module(reader), scope):
                    continue
                if is_cast(reader):
                    cast_backs.add(reader)
                    continue
                rule = POLICY.get(op(reader))
                if rule is None or rule.op_class in STOPS:
                    continue
                region[reader] = upcast
                stack.append(reader)
    return region


def _inside(path: str, scope: str) -> bool:
    return not scope or path == scope or path.startswith(scope + ".")


def keep_upcasts_fp32(upcasts: Iterable[Hashable], readers: Callable[[Hashable], Iterable[Hashable]],
                      op: Callable[[Hashable], str | None], is_cast: Callable[[Hashable], bool],
                      module: Callable[[Hashable], str], spelling: Callable[[Hashable], str],
                      name: Callable[[Hashable], str] = str) -> Callable[[nx.DiGraph], None]:
    """The hook, for one IR's nodes (see upcast_regions); `spelling(cast)` says how the model wrote it
    (".to(float32)", ".float()"), `name(node)` is the node's name in the view."""
    region = {name(node): (name(upcast), spelling(upcast))
              for node, upcast in upcast_regions(upcasts, readers, op, is_cast, module).items()}

    def hook(view: nx.DiGraph) -> None:
        for node, (upcast, spelled) in region.items():
            if node in view:
                keep_fp32(view, node, f"upcast: the model's own {spelled} at {upcast}: computes on its fp32 value up "
                                      "to the model's cast back, kept fp32 (autocast and Apex O2 honour it)",
                          relabel_fp32=True)
    return hook
