"""Keep fp32 the argument of sin/cos and the arithmetic that computes it (a `painted` hook of the decide
step, decide.py, any IR).

    emb = timesteps.float()[:, None] * exp(-log(10000) * arange(half) / half)[None]   # diffusers, O2 bf16
    emb = cat([sin(emb), cos(emb)], -1)        view nodes "mul_2", "sin", "cos": low -> fp32, rule "phase: ..."

A phase is a magnitude read modulo 2*pi: bf16 holds 1000 in steps of 4 (fp16 in steps of 0.5), so a
timestep embedding computed low is noise, and the UNet it conditions drifts (O2 bf16 error 4x autocast's;
autocast and model.to(bf16) keep it fp32: the timesteps come in as integers and `.float()` them). So sin and
cos run fp32, and so does every node their argument is computed by through arithmetic, dtype casts and data
movement (the ops that carry a position, keep_coordinates_fp32.carries_position), back to the first node of
another kind (a matmul, exp, a parameter), whose output is already what it is. Their own outputs are in
[-1, 1]: their readers stay as decided. A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from amp_compiler.passes.painting.keep_coordinates_fp32 import carries_position
from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.numerics import PERIODIC_OPS


def keep_phases_fp32(op: Callable[[str], str | None]) -> Callable[[nx.DiGraph], None]:
    """The hook; `op(name)` is the canonical op of the view node `name`."""
    def hook(view: nx.DiGraph) -> None:
        for node in [n for n in view if op(n) in PERIODIC_OPS]:
            if not keep_fp32(view, node, f"phase: {op(node)} of an argument computed in fp32 (bf16 holds 1000 "
                                          "in steps of 4: the phase would be noise)"):
                continue
            stack, seen = [node], {node}
            while stack:
                for producer in view.predecessors(stack.pop()):
                    if producer in seen or not carries_position(op(producer)):
                        continue
                    seen.add(producer)
                    if keep_fp32(view, producer, f"phase: computes the argument of {op(node)} {node}: a phase "
                                                  "rounded to low precision is off by its rounding, kept fp32"):
                        stack.append(producer)
    return hook
