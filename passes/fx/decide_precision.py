"""Decide a precision for every fx node: the shared decide step (passes/painting/decide.py) with an fx adapter.

    node.meta["amp"] += {class, family, reason, module, precision: "low"|"fp32"|None, rule}

Only nodes that compute on fp32/fp16/bf16 values are painted; the rest keep precision None and are
never cast (integers, bools, fp64, shapes). Reads meta["amp"]["op"] (canonicalize) and ["dtype"]
(infer_dtypes, original dtypes).
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.fx.aliases import written_views
from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.painting.decide import decide
from amp_compiler.passes.painting.keep_constants_fp32 import beyond_rule
from amp_compiler.passes.painting.paint_precision import PAINTABLE
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.policy.numerics import UNARY_IN_PLACE_OPS, dtype_name, low_max
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.node_facts import facts


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
    return any(is_float(facts(a).get("dtype")) for a in node.all_input_nodes) or \
        is_float(facts(node).get("dtype"))


def constant_beyond(node: fx.Node, limit: float) -> float | None:
    """A Python number argument beyond `limit` (masked_fill(-1e9) past fp16's 65504, finfo(float32).min past
    bf16's 3.39e38), else None. Integer arguments of data-movement ops are sizes and dims, not values."""
    family = facts(node).get("family") or getattr(POLICY.get(facts(node).get("op")), "family", None)
    leaves: list = []
    fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
    for value in leaves:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int) and family == "shape":
            continue
        if abs(value) > limit and abs(value) != float("inf"):
            return value
    return None


class FxNodes:
    """The fx side of the decide step (passes/painting/decide.py)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm

    def nodes(self) -> list[fx.Node]:
        for node in self.gm.graph.nodes:
            facts(node)["module"] = module_path(node)
        return list(self.gm.graph.nodes)

    def name(self, node: fx.Node) -> str:
        return node.name

    def meta(self, node: fx.Node) -> dict:
        return facts(node)

    def fixed_class(self, node: fx.Node) -> dict | None:
        if node.op in ("placeholder", "get_attr", "output"):
            return {"class": "io", "family": "io", "reason": "graph input/output/parameter"}
        return None

    def set_aside(self, node: fx.Node, op_class: str) -> tuple[str | None, str] | None:
        if facts(node).get("inplace"):
            return "inplace", "in-place op: runs in the dtype of the tensor it writes (a cast would write a copy)"
        if not _computes_on_floats(node):
            return None, "no fp32/fp16/bf16 operand (int, bool or fp64): untouched"
        return None

    def classified(self) -> None:
        # A view an in-place op writes through (v = h[:, :4]; v.mul_(2)) must read its base as it is: a cast
        # between them would put the write on a copy and h would never see it. So the views on the way from
        # the write to its base are set aside, like the write itself.
        for node in self.gm.graph.nodes:
            for view in written_views(node):
                amp = facts(view)
                if amp.get("family") == "shape" and amp.get("class") in PAINTABLE:   # the views, not the base
                    amp["class"], amp["reason"] = "ignore", \
                        f"a view written in place by {node.name}: reads its base uncast, so the write reaches it"

    def forced(self, node: fx.Node, rules: PrecisionRules) -> tuple[str, str] | None:
        amp = facts(node)
        forced = rules.forced(amp["module"], node.name)
        if forced is not None and forced[0] == "fp32":
            return forced
        if not any(is_float(facts(a).get("dtype")) for a in node.all_input_nodes) and node.op != "call_module":
            # int64 / 8, ints * 0.5: type promotion computes the default float dtype; no cast reaches it
            kind = "complex" if any(getattr(facts(a).get("dtype"), "is_complex", False)   # abs(rfft(x))
                                    for a in node.all_input_nodes) else "integer"
            return ("fp32", f"{amp['class']}: {kind} operands only: computes {dtype_name(amp.get('dtype'))} "
                            "by type promotion, whatever the level")
        big = constant_beyond(node, low_max(rules.low_dtype)) if forced is None else None
        if big is not None:
            forced = ("fp32", beyond_rule(amp["class"], f"the constant {big:g}", rules.low_dtype))
        return forced

    def edges(self):
        for node in self.gm.graph.nodes:
            for user in node.users:
                yield node.name, user.name
            # An in-place op is set aside, but the value it writes flows on: its readers are joined to the
            # written tensor's producer (bn -> relu_ -> conv paints as bn -> conv, as if the op were out of place).
            # Only unary writes (relu_, silu_, dropout): one with a second float operand (add_, baddbmm_) keeps
            # the cut, its operands follow the written tensor's dtype.
            written = node
            while _unary_write(written):
                written = written.args[0]
            if written is not node:
                for user in node.users:
                    yield written.name, user.name

    def record(self, node: fx.Node, amp: dict, painted: dict | None, rules: PrecisionRules) -> None:
        if painted is not None:
            state_statistics = amp["op"] == "batch_norm" and _reads_statistics_as_inputs(node)
            amp["fp32_weights"] = amp["precision"] == "low" and (rules.keeps_fp32_weights(amp["op"])
                                                                 or state_statistics)
            if amp["fp32_weights"] and amp["reason"] not in amp["rule"]:   # painted by a neighbour: say why
                amp["rule"] = f"{amp['rule']}; mixed kernel: fp32 weights and statistics"
            elif amp["fp32_weights"] and state_statistics and not rules.keeps_fp32_weights(amp["op"]):
                amp["rule"] = (f"{amp['rule']}; mixed kernel: its running statistics are the model's buffers, "
                               "updated in place (a low copy would take the update away), fp32 weights with them")


def _reads_statistics_as_inputs(node: fx.Node) -> bool:
    """batch_norm whose running statistics are graph inputs (TorchDynamo passes buffers as placeholders): a cast of
    them would run the in-place update on the copy. (fx reads them with get_attr from the module it calls.)"""
    statistics = node.args[1:3]
    return any(isinstance(s, fx.Node) and s.op == "placeholder" for s in statistics)


def _unary_write(node: fx.Node) -> bool:
    """An in-place activation (relu_, silu_, dropout_...) whose only float operand is the tensor it writes.
    Not masked_fill_ and the like: they write into tensors made with an explicit dtype (zeros_like(m,
    dtype=q.dtype)), which painting cannot change."""
    op = facts(node).get("op")
    rule = POLICY.get(op)
    activation = op in UNARY_IN_PLACE_OPS or (rule is not None and rule.family == "activation")
    if not (activation and facts(node).get("inplace") and node.args and isinstance(node.args[0], fx.Node)):
        return False
    return not any(is_float(facts(a).get("dtype")) for a in node.all_input_nodes if a is not node.args[0])


def decide_fx_precision(gm: fx.GraphModule, rules: PrecisionRules, painted=()) -> PassResult:
    """`painted`: hooks that see the painted view before the precisions are written back."""
    return PassResult(modified=False, counts=decide(FxNodes(gm), rules, painted))
