"""Decide a precision for every fx node: classify by the rules, paint on a format-neutral view, record.

    node.meta["amp"] += {class, family, reason, module, precision: "low"|"fp32"|None, rule}

Only nodes that compute on fp32/fp16/bf16 values are painted; the rest keep precision None and are
never cast (integers, bools, fp64, shapes). Reads meta["amp"]["op"] (canonicalize) and ["dtype"]
(infer_dtypes, original dtypes).
"""
from __future__ import annotations

import networkx as nx
import torch.fx as fx

from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.painting.paint_precision import PAINTABLE, paint_precision
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.policy.rules import PrecisionRules


def module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return node.target
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # torch.export writes "L['self'].encoder.layer" style paths; keep the attribute path.
    return path.replace("L['self'].", "").replace("L['self']", "")


def _computes_on_floats(node: fx.Node) -> bool:
    return any(is_float(a.meta["amp"].get("dtype")) for a in node.all_input_nodes) or \
        is_float(node.meta["amp"].get("dtype"))


FP16_MAX = 65504.0


def _out_of_fp16_range(node: fx.Node) -> float | None:
    """A Python number argument fp16 cannot hold (masked_fill(-1e9), x * 1e5), else None. Integer
    arguments of data-movement ops are sizes and dims, not values."""
    leaves: list = []
    fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
    for value in leaves:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int) and node.meta["amp"].get("family") == "shape":
            continue
        if abs(value) > FP16_MAX and abs(value) != float("inf"):
            return value
    return None


def build_view(gm: fx.GraphModule, rules: PrecisionRules) -> nx.DiGraph:
    view = nx.DiGraph()
    for node in gm.graph.nodes:
        amp = node.meta["amp"]
        amp["module"] = module_path(node)
        if node.op in ("placeholder", "get_attr", "output"):
            amp.update({"class": "io", "family": "io", "reason": "graph input/output/parameter"})
            continue
        klass, family, reason = rules.classify(amp["op"])
        amp.update({"class": klass, "family": family, "reason": reason})
        if amp.get("inplace") and klass in PAINTABLE:
            amp["class"], amp["family"] = "ignore", "inplace"
            amp["reason"] = "in-place op: runs in the dtype of the tensor it writes (a cast would write a copy)"
        elif klass in PAINTABLE and not _computes_on_floats(node):
            amp["class"], amp["reason"] = "ignore", "no fp32/fp16/bf16 operand (int, bool or fp64): untouched"
        if amp["class"] == "ignore":
            continue
        forced = rules.forced(amp["module"], node.name)
        big = _out_of_fp16_range(node) if rules.low_dtype == "float16" and forced is None else None
        if big is not None:
            forced = ("fp32", f"{amp['class']}: reads the constant {big:g}, beyond fp16's 65504: kept fp32")
        view.add_node(node.name, cls=amp["class"], reason=amp["reason"], forced=forced)
    for node in gm.graph.nodes:
        for user in node.users:
            if node.name in view and user.name in view:
                view.add_edge(node.name, user.name)
    return view


def decide_fx_precision(gm: fx.GraphModule, rules: PrecisionRules) -> PassResult:
    view = build_view(gm, rules)
    rules.check_all_patterns_matched()
    counts = paint_precision(view, bf16=rules.low_dtype == "bfloat16")
    for node in gm.graph.nodes:
        amp = node.meta["amp"]
        if node.name in view:
            amp["precision"] = view.nodes[node.name]["precision"]
            amp["rule"] = view.nodes[node.name]["rule"]
            amp["fp32_weights"] = amp["precision"] == "low" and rules.keeps_fp32_weights(amp["op"])
        else:
            amp["precision"] = None
            amp["rule"] = amp["reason"]
    return PassResult(modified=False, counts=counts)
