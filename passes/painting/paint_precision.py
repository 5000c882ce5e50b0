"""Paint a precision on every float node of a format-neutral view (TensorFlow's AMP painting).

    view: networkx.DiGraph, node attrs  op_class in allow/infer/deny/clear, reason, forced=(precision, rule)|None
    ->    node attrs  precision in {"low", "fp32"}, rule (why)

Steps, in order (each later step only paints what earlier steps left):
 1. user-forced nodes keep their precision;  2. allow ops are low;  3. deny ops are fp32;
 4. fp32 spreads forward from deny ops through clear/infer ops that lead into a deny/infer op
    (so a softmax's consumers do not bounce back to low precision and up again);
 5. clear/infer ops lying between two low ops become low (no cast pair around a bias add or a gelu);
 6. bf16 only: an infer op with a low input and no fp32 input becomes low (bf16 cannot overflow);
 7. low spreads through clear ops connected to low ops (reshapes follow their data);
 8. what is left stays fp32.
The same function paints fx graphs and ONNX graphs: the view is all it sees.
"""
from __future__ import annotations

import networkx as nx

LOW, FP32 = "low", "fp32"
PAINTABLE = ("allow", "infer", "deny", "clear")
FOLLOWERS = ("infer", "clear")


def paint_precision(view: nx.DiGraph, *, bf16: bool) -> dict[str, int]:
    nodes = [n for n, a in view.nodes(data=True) if a["op_class"] in PAINTABLE]
    # A subgraph view filters every neighbour lookup: walk the view itself when nothing is left out (ONNX).
    graph = view if len(nodes) == view.number_of_nodes() else view.subgraph(nodes)
    op_class = {n: view.nodes[n]["op_class"] for n in nodes}
    precision: dict = {}
    rule: dict = {}

    def paint(n, p, why):
        precision[n], rule[n] = p, why

    for n in nodes:  # 1-3
        forced = view.nodes[n].get("forced")
        if forced:
            paint(n, *forced)
        elif op_class[n] == "allow":
            paint(n, LOW, f"allow: {view.nodes[n]['reason']}")
        elif op_class[n] == "deny":
            paint(n, FP32, f"deny: {view.nodes[n]['reason']}")

    open_followers = lambda n: n not in precision and op_class[n] in FOLLOWERS  # noqa: E731

    # 4. fp32 forward from deny, only into followers that lead to a deny/infer op.
    feeds_fragile = _closure(graph, [n for n in nodes if op_class[n] in ("deny", "infer")],
                             graph.predecessors, open_followers)
    for src in [n for n in nodes if precision.get(n) == FP32 and op_class[n] == "deny"]:
        for n in _closure(graph, [src], graph.successors, lambda m: open_followers(m) and m in feeds_fragile):
            if n != src:
                paint(n, FP32, f"{op_class[n]}: fed by fp32 op {src}, leads into an fp32 op")

    # 5. close gaps between low ops.
    low = [n for n in nodes if precision.get(n) == LOW]
    between = (_closure(graph, low, graph.successors, open_followers)
               & _closure(graph, low, graph.predecessors, open_followers))
    for n in nodes:
        if n in between and n not in precision:
            paint(n, LOW, f"{op_class[n]}: between low-precision ops")

    # 6. bf16: infer ops follow low inputs.
    if bf16:
        for n in nx.topological_sort(graph):
            if open_followers(n) and op_class[n] == "infer":
                inputs = [precision.get(p) for p in graph.predecessors(n)]
                if LOW in inputs and FP32 not in inputs:
                    paint(n, LOW, "infer: low-precision input, no fp32 input (bf16 cannot overflow)")

    # 7. low spreads through connected clear ops.
    undirected = graph.to_undirected(as_view=True)
    low = [n for n in nodes if precision.get(n) == LOW]
    for n in _closure(undirected, low, undirected.neighbors, lambda m: m not in precision and op_class[m] == "clear"):
        if n not in precision:
            paint(n, LOW, "clear: joined to a low-precision neighbour")

    leftover = {"infer": "infer: not between low-precision ops, so fp32",
                "clear": "clear: not joined to a low-precision op, so fp32"}
    for n in nodes:  # 8
        if n not in precision:
            paint(n, FP32, leftover[op_class[n]])

    nx.set_node_attributes(view, precision, "precision")
    nx.set_node_attributes(view, rule, "rule")
    return {"low": sum(p == LOW for p in precision.values()), "fp32": sum(p == FP32 for p in precision.values())}


def _closure(graph, starts, step, admit) -> set:
    """Nodes reachable from `starts` by `step` through nodes that `admit` accepts (starts included)."""
    seen, stack = set(starts), list(starts)
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen and admit(nxt):
                seen.add(nxt)
                stack.append(nxt)
    return seen


def keep_fp32(view: nx.DiGraph, name: str, rule: str, *, relabel_fp32: bool = False) -> bool:
    """A painted hook's step: the node runs fp32 with `rule`, forced, so that cast placement (a later hook)
    never moves it back to low. Only a low node changes, or, with relabel_fp32, an fp32 one that no rule
    forced either (its rule becomes `rule`). Returns False where the user forced the node low: it stays
    low, and a walk through it stops there."""
    attrs = view.nodes[name]
    forced = attrs.get("forced")
    if forced and forced[0] == "low":
        return False
    if attrs.get("precision") == "low" or (relabel_fp32 and not forced):
        attrs["precision"], attrs["rule"], attrs["forced"] = FP32, rule, (FP32, rule)
    return True
