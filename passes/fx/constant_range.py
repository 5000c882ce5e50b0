"""Constants beyond the low dtype's range: where they are (for the decide step's hook that keeps their
paths fp32, painting/keep_constants_fp32.py), and a warning where a float16 op reads one anyway.

    scores.masked_fill(mask, -1e9) [fp32: reads -1e9] -> softmax [forced low by the user at O2]
    FP16RangeWarning: masked_fill reads the constant -1e+09, beyond fp16's 65504 (it runs fp32); its
    value reaches softmax in float16, where the cast makes it -inf ...

`constants_beyond_range` finds, before decide_precision, the nodes that hold or read such a constant (a
Python number argument, a tensor constant); `magnitude_carriers` the nodes whose op keeps its magnitude
(infer/clear in the policy table). The hook keeps their value's path fp32 at every level, so a float16
reader is left only where the user forced one low: -1e9 becomes -inf there, and a fully masked row NaN.
The value is followed through fp32 infer/clear nodes to the first low readers; a deny node (softmax, a
norm, a reduction) ends the path. Tensor constants (get_attr) count too. Writes facts(node)["warning"] on
the node that reads the constant; explain()'s summary lists it.
"""
from __future__ import annotations

import sys
import warnings
from functools import reduce
from pathlib import Path

import torch
import torch.fx as fx

from amp_compiler.passes.fx.decide_precision import constant_beyond
from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import FP16_MAX, dtype_name, low_max
from amp_compiler.passes.policy.op_policy import policy_for
from amp_compiler.passes.runner import PassResult

KEEP_MAGNITUDE = ("infer", "clear")   # classes whose fp32 output carries an input's magnitude on


class FP16RangeWarning(UserWarning):
    """A value beyond fp16's range reaches a float16 op: it becomes inf there."""


def warn_constants_beyond_fp16(gm: fx.GraphModule) -> PassResult:
    """After decide_precision on a float16 conversion: one warning per constant that reaches a low op."""
    warned = 0
    for node in gm.graph.nodes:
        value = _constant_beyond_fp16(gm, node)
        if value is None:
            continue
        readers = [node] if facts(node).get("precision") == "low" else _low_readers(node)
        if readers:
            message = _message(node, value, readers)
            facts(node)["warning"] = message
            warnings.warn(message, FP16RangeWarning, stacklevel=_callers_level())
            warned += 1
    return PassResult(modified=False, counts={"warnings": warned} if warned else {})


def _callers_level() -> int:
    """The stack level of the first frame outside amp_compiler (and its passes): the user's convert() call."""
    ours = (str(Path(sys.modules["amp_compiler"].__file__).parent), str(Path(__file__).parents[1]))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def constants_beyond_range(gm: fx.GraphModule, low_dtype: torch.dtype) -> dict[str, tuple[str, list[str]]]:
    """Before decide_precision: every node that holds or reads a constant beyond the low dtype's largest
    number, as painting/keep_constants_fp32.py takes it: name -> (what it holds, its readers' names)."""
    limit, sources = low_max(low_dtype), {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op in ("call_function", "call_method", "call_module")
                                     and (is_float(facts(node).get("dtype")) or
                                          any(is_float(facts(a).get("dtype")) for a in node.all_input_nodes))):
            value = _constant_beyond(gm, node, limit)
            if value is not None:
                what = (f"the tensor constant {node.target}, which holds {value:g}" if node.op == "get_attr"
                        else f"the constant {value:g}")
                sources[node.name] = (what, [user.name for user in node.users])
    return sources


def magnitude_carriers(gm: fx.GraphModule, low_dtype: torch.dtype) -> set[str]:
    """Nodes whose op the policy table calls infer or clear: their output carries an input's magnitude on."""
    table = policy_for(dtype_name(low_dtype))
    return {node.name for node in gm.graph.nodes
            if getattr(table.get(facts(node).get("op")), "op_class", None) in KEEP_MAGNITUDE}


def _constant_beyond_fp16(gm: fx.GraphModule, node: fx.Node) -> float | None:
    if node.op in ("call_function", "call_method", "call_module") and facts(node).get("precision") is None:
        return None
    return _constant_beyond(gm, node, FP16_MAX)


def _constant_beyond(gm: fx.GraphModule, node: fx.Node, limit: float) -> float | None:
    if node.op == "get_attr":
        tensor = reduce(getattr, node.target.split("."), gm)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        if tensor.is_meta:   # a model built on the meta device has no values yet: nothing to find (README)
            return None
        low, high = (v.item() for v in torch.aminmax(tensor.detach()))   # no copy of a large weight
        if not (abs(low) < float("inf") and abs(high) < float("inf")):   # inf/nan inside: the finite ones
            finite = tensor.detach()[tensor.detach().isfinite()]
            if finite.numel() == 0:
                return None
            low, high = finite.min().item(), finite.max().item()
        value = low if -low > high else high
        return value if abs(value) > limit else None
    if node.op in ("call_function", "call_method", "call_module"):
        return constant_beyond(node, limit)
    return None


def _low_readers(source: fx.Node) -> list[fx.Node]:
    """Low nodes that read `source`'s value directly or through fp32 nodes that keep its magnitude."""
    seen, stack, found = {source}, [source], []
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            amp = facts(user)
            if amp.get("precision") == "low":
                found.append(user)
            elif amp.get("precision") == "fp32" and amp.get("class") in KEEP_MAGNITUDE:
                stack.append(user)
    return found


def _message(source: fx.Node, value: float, readers: list[fx.Node]) -> str:
    what = (f"the tensor constant {source.target} holds {value:g}" if source.op == "get_attr"
            else f"{source.name} reads the constant {value:g}")
    runs = "" if source.op == "get_attr" or facts(source).get("precision") == "low" else " (it runs fp32)"
    names = ", ".join(f"{r.name} ({facts(r).get('op', '?')})" for r in readers[:4])
    names += f" and {len(readers) - 4} more" if len(readers) > 4 else ""
    infinity = "-inf (a softmax row that is all -inf gives NaN)" if value < 0 else "inf"
    return (f"{what}, beyond fp16's 65504{runs}; its value reaches {names} in float16, where it becomes "
            f"{infinity}. Keep the readers fp32 "
            f"(force_fp32=[{', '.join(repr(r.name) for r in readers[:4])}]), convert with dtype=torch.bfloat16, "
            "or use a value fp16 holds (torch.finfo(torch.float16).min)")
