"""painting/decide.py with a stub adapter over a graph of dicts: the outline every IR shares (classify, set
aside, force, paint, hooks, write back), seen without the fx or ONNX adapters."""
import pytest

from amp_compiler.passes.painting.decide import decide
from amp_compiler.passes.policy.rules import PrecisionRules

# name -> (canonical op, inputs): x -> fc -> sm -> fc2 -> out, and an integer branch x -> idx
GRAPH = {"x": ("placeholder", []), "fc": ("linear", ["x"]), "sm": ("softmax", ["fc"]), "fc2": ("linear", ["sm"]),
         "idx": ("mul", ["x"]), "out": ("output", ["fc2", "idx"])}
IO = {"class": "io", "family": "io", "reason": "graph input/output"}


class DictNodes:
    """The adapter of an IR whose nodes are names; it logs the calls decide makes."""

    def __init__(self, graph=GRAPH, aside=None, forced=None):
        self.graph, self.aside, self.forced_ = graph, aside or {}, forced or {}
        self.facts = {name: {"op": op} for name, (op, _) in graph.items()}
        self.calls, self.recorded = [], {}

    def nodes(self):
        return list(self.graph)

    def name(self, node):
        return node

    def meta(self, node):
        return self.facts[node]

    def fixed_class(self, node):
        return dict(IO) if self.graph[node][0] in ("placeholder", "output") else None

    def set_aside(self, node, op_class):
        return self.aside.get(node)

    def classified(self):
        self.calls.append("classified")

    def forced(self, node, rules):
        self.calls.append(f"forced {node}")
        return self.forced_.get(node)

    def edges(self):
        return [(i, name) for name, (_, inputs) in self.graph.items() for i in inputs]

    def record(self, node, amp, painted, rules):
        self.recorded[node] = None if painted is None else dict(painted)


def rules(**options):
    return PrecisionRules.build("O1", "float16", **options)


def test_every_node_is_classified_painted_and_recorded():
    adapter = DictNodes()
    counts = decide(adapter, rules())
    f = adapter.facts
    assert (f["fc"]["class"], f["fc"]["family"], f["fc"]["precision"]) == ("allow", "matmul", "low")
    assert (f["sm"]["class"], f["sm"]["family"], f["sm"]["precision"]) == ("deny", "softmax", "fp32")
    assert f["fc"]["rule"] == f"allow: {f['fc']['reason']}"
    assert f["x"] == {"op": "placeholder", **IO, "precision": None, "rule": IO["reason"]}   # outside the view
    assert set(adapter.recorded) == set(GRAPH) and adapter.recorded["x"] is None
    assert adapter.recorded["fc"]["precision"] == "low"
    assert counts == {"low": 2, "fp32": 2}   # fc, fc2 low; sm and idx (infer, no low neighbour on both sides) fp32


def test_a_node_set_aside_is_ignored_with_the_adapters_reason_and_left_out_of_the_view():
    adapter = DictNodes(aside={"idx": (None, "no float operand"), "sm": ("inplace", "in-place op")})
    decide(adapter, rules())
    assert adapter.facts["idx"] == {"op": "mul", "class": "ignore", "family": "arithmetic",
                                         "reason": "no float operand", "precision": None, "rule": "no float operand"}
    assert (adapter.facts["sm"]["class"], adapter.facts["sm"]["family"]) == ("ignore", "inplace")
    assert adapter.recorded["sm"] is None
    assert not any(call in ("forced sm", "forced idx") for call in adapter.calls)   # only view nodes are asked


def test_the_adapter_is_told_when_classification_is_done_before_anything_is_forced():
    adapter = DictNodes(forced={"sm": ("low", "user rule: force_low 'sm'")})
    decide(adapter, rules())
    assert adapter.calls[0] == "classified" and sorted(adapter.calls[1:]) == ["forced fc", "forced fc2",
                                                                              "forced idx", "forced sm"]
    assert (adapter.facts["sm"]["precision"], adapter.facts["sm"]["rule"]) == ("low", "user rule: force_low 'sm'")


def test_hooks_run_in_order_on_the_painted_view_and_the_counts_follow_them():
    adapter, seen = DictNodes(), []

    def first(view):
        seen.append(("first", view.nodes["fc"]["precision"], adapter.facts["fc"].get("precision")))
        view.nodes["fc"].update(precision="fp32", rule="hook: kept fp32")

    def second(view):
        seen.append(("second", view.nodes["fc"]["precision"], None))

    counts = decide(adapter, rules(), painted=[first, second])
    assert seen == [("first", "low", None), ("second", "fp32", None)]   # painted, not yet written back
    assert (adapter.facts["fc"]["precision"], adapter.facts["fc"]["rule"]) == ("fp32", "hook: kept fp32")
    assert counts["low"] == 1 and counts["fp32"] == 3


def test_a_hook_that_changes_nothing_changes_no_decision():
    plain, hooked = DictNodes(), DictNodes()
    counts = decide(plain, rules())
    assert decide(hooked, rules(), painted=[lambda view: None]) == counts
    assert hooked.facts == plain.facts


def test_an_unknown_op_is_denied_and_named():
    adapter = DictNodes({**GRAPH, "sm": ("my_op", ["fc"])})
    decide(adapter, rules())
    assert (adapter.facts["sm"]["class"], adapter.facts["sm"]["family"]) == ("deny", "unknown")
    assert adapter.facts["sm"]["precision"] == "fp32" and "unknown op 'my_op'" in adapter.facts["sm"]["rule"]


def test_user_lists_are_checked_against_the_graph():
    with pytest.raises(ValueError, match="softmx"):
        decide(DictNodes(), rules(deny_ops=["softmx"]))
    decide(DictNodes({**GRAPH, "sm": ("softmx", ["fc"])}), rules(deny_ops=["softmx"]))   # this graph calls it
    with pytest.raises(ValueError, match="matched no module path or node name"):
        decide(DictNodes(), rules(force_fp32=["encoder.*"]))   # the stub adapter never matches a pattern
