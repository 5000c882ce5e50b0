"""The fx side of keep_upcasts_fp32 (passes/painting/keep_upcasts_fp32.py): which nodes are the model's own
upcasts to float32, and how it wrote them. Returns the `painted` hook of the decide step.

    x.float(), x.to(torch.float32), x.type(torch.float32), x.to(dtype=torch.float32)   (fx.symbolic_trace)
    aten.to.dtype(x, torch.float32) whose source line writes float32                     (torch.export)

torch.export specialises every dtype: `h.to(input_dtype)` of an fp32 capture is aten.to.dtype(h, float32)
too, so there the cast is an upcast only where the line of the model it comes from (the node's stack
trace) spells float32 (`.float()`, `torch.float32`, `torch.float`); another cast ends a walk, as a cast back.
Only casts of a float value count: `mask.float()` of a bool makes a number, not an fp32 computation.
"""
from __future__ import annotations

import re
from typing import Callable

import networkx as nx
import torch
import torch.fx as fx

from amp_compiler.passes.fx.decide_precision import module_path
from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_upcasts_fp32 import keep_upcasts_fp32
from amp_compiler.passes.policy.op_policy import POLICY

FLOAT32_IN_SOURCE = re.compile(r"\.float\(\)|torch\.float32\b|torch\.float\b")


def is_user_cast(node: fx.Node) -> bool:
    rule = POLICY.get(facts(node).get("op"))
    return node.op in ("call_method", "call_function") and rule is not None and rule.family == "user_cast"


def _writes_float32(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target == "float":
        return True
    if facts(node).get("op") not in ("to", "type"):
        return False
    if torch.float32 not in (*node.args[1:], node.kwargs.get("dtype")):
        return False
    if isinstance(node.target, torch._ops.OpOverload):   # torch.export: the dtype is specialised, read the source
        trace = node.meta.get("stack_trace") or ""
        lines = trace.strip().splitlines()
        return bool(lines) and FLOAT32_IN_SOURCE.search(lines[-1]) is not None
    return True


def is_upcast(node: fx.Node) -> bool:
    """The model's own cast of a float value to float32."""
    source = node.args[0] if node.args else None
    return is_user_cast(node) and isinstance(source, fx.Node) and \
        is_float(facts(source).get("dtype")) and _writes_float32(node)


def spelling(node: fx.Node) -> str:
    return {"float": ".float()", "type": ".type(torch.float32)"}.get(node.target, ".to(float32)") \
        if node.op == "call_method" else ".to(float32)"


def keep_fx_upcasts_fp32(gm: fx.GraphModule) -> Callable[[nx.DiGraph], None]:
    return keep_upcasts_fp32([n for n in gm.graph.nodes if is_upcast(n)], lambda n: n.users,
                             lambda n: facts(n).get("op"), is_user_cast, module_path, spelling, lambda n: n.name)
