"""The decide step every front end shares: classify, set aside what is not painted, force, paint, record.

    decide(FxNodes(gm), rules)          # passes/fx/decide_precision.py
    decide(OnnxNodes(model, ...), rules) # passes/onnx/decide_precision.py

node.meta["amp"] += {class, family, reason, precision: "low"|"fp32"|None, rule} for every node. The outline:
1. classify every node's canonical op with the rules; an adapter may set a paintable node aside
   ("ignore", with the reason: no float operand, an in-place write, an untyped value...);
2. build the format-neutral view (networkx): one vertex per paintable node with its class, reason and
   forced precision (the adapter says what forces it, in its IR's precedence), an edge per float value;
3. check that every force_* pattern matched, paint (paint_precision), run the `painted` hooks on the
   painted view (a pass that works on the painted graph, such as a cast-placement pass, hooks in here),
   and write each node's precision and rule back.
An adapter is the IR-specific part: which nodes, their meta, what sets a node aside or forces it, the
edges between nodes, and what else it records.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

import networkx as nx

from amp_compiler.passes.painting.paint_precision import PAINTABLE, paint_precision
from amp_compiler.passes.policy.rules import PrecisionRules

PaintedHook = Callable[[nx.DiGraph], None]


class DecideAdapter(Protocol):
    def nodes(self) -> list: ...
    def name(self, node) -> str: ...
    def meta(self, node) -> dict: ...
    def fixed_class(self, node) -> dict | None: ...              # class/family/reason of a node no rule classifies
    def set_aside(self, node, op_class: str) -> tuple[str, str] | None: ...   # (family or None, reason) -> "ignore"
    def classified(self) -> None: ...                           # every node classified: before forcing
    def forced(self, node, rules: PrecisionRules) -> tuple[str, str] | None: ...
    def edges(self) -> Iterable[tuple[str, str]]: ...           # (producer name, reader name), float values
    def record(self, node, amp: dict, painted: dict | None, rules: PrecisionRules) -> None: ...


def decide(adapter: DecideAdapter, rules: PrecisionRules, painted: Iterable[PaintedHook] = ()) -> dict[str, Any]:
    nodes = adapter.nodes()
    for node in nodes:
        amp = adapter.meta(node)
        fixed = adapter.fixed_class(node)
        if fixed is not None:
            amp.update(fixed)
            continue
        amp.update(zip(("class", "family", "reason"), rules.classify(amp["op"])))
        if amp["class"] in PAINTABLE:
            aside = adapter.set_aside(node, amp["class"])
            if aside is not None:
                family, reason = aside
                amp["class"], amp["reason"] = "ignore", reason
                if family is not None:
                    amp["family"] = family
    rules.check_op_names(adapter.meta(node).get("op") for node in nodes)   # a typo in deny_ops is an error
    adapter.classified()
    view = nx.DiGraph()
    for node in nodes:
        amp = adapter.meta(node)
        if amp["class"] in PAINTABLE:
            view.add_node(adapter.name(node), op_class=amp["class"], reason=amp["reason"], forced=adapter.forced(node, rules))
    for producer, reader in adapter.edges():
        if producer in view and reader in view:
            view.add_edge(producer, reader)
    rules.check_all_patterns_matched()
    counts = paint_precision(view, bf16=rules.low_dtype == "bfloat16")
    if painted:
        for hook in painted:
            hook(view)
        precisions = [attrs["precision"] for _, attrs in view.nodes(data=True)]   # as the hooks left them
        counts = {**counts, "low": precisions.count("low"), "fp32": precisions.count("fp32")}
    for node in nodes:
        amp = adapter.meta(node)
        name = adapter.name(node)
        attrs = view.nodes[name] if name in view else None
        if attrs is not None:
            amp["precision"], amp["rule"] = attrs["precision"], attrs["rule"]
        else:
            amp["precision"], amp["rule"] = None, amp["reason"]
        adapter.record(node, amp, attrs, rules)
    return counts
