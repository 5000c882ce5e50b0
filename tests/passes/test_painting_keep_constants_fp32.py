"""painting/keep_constants_fp32.py on hand-built painted views: the path of a constant the low dtype cannot
hold runs fp32 from the node that reads it, through the magnitude carriers, up to the first other reader."""
import networkx as nx

from amp_compiler.passes.painting.keep_constants_fp32 import beyond_rule, keep_constant_paths_fp32
from amp_compiler.passes.painting.paint_precision import paint_precision

BF16_MIN = "the constant -3.40282e+38"


def painted_view(nodes, edges, forced=None) -> nx.DiGraph:
    """A view as decide() hands it to hooks: every node painted (O2 classes every op allow: all low)."""
    view = nx.DiGraph()
    for name, op_class in nodes.items():
        view.add_node(name, op_class=op_class, reason=f"{op_class} op", forced=(forced or {}).get(name))
    view.add_edges_from(edges)
    paint_precision(view, bf16=True)
    return view


def snapshot(view) -> dict:
    return {n: (a["precision"], a["rule"], a["forced"]) for n, a in view.nodes(data=True)}


ATTENTION = {"scores": "allow", "masked_fill": "allow", "add": "allow", "softmax": "allow", "matmul": "allow"}
ATTENTION_EDGES = [("scores", "masked_fill"), ("masked_fill", "add"), ("add", "softmax"), ("softmax", "matmul")]
CARRIERS = {"masked_fill", "add"}   # the policy's clear/infer ops (O2's view calls them all allow)


def test_beyond_rule_names_the_constant_and_the_low_dtypes_limit():
    assert beyond_rule("clear", "the constant -1e+09", "float16") == \
        "clear: reads the constant -1e+09, beyond fp16's 65504: kept fp32"
    assert beyond_rule("deny", BF16_MIN, "bfloat16") == \
        "deny: reads the constant -3.40282e+38, beyond bf16's 3.3895e+38: kept fp32"


def test_the_reader_and_the_path_through_carriers_run_fp32_up_to_the_first_other_reader():
    view = painted_view(ATTENTION, ATTENTION_EDGES)
    assert {p for _, p in view.nodes(data="precision")} == {"low"}
    keep_constant_paths_fp32({"masked_fill": (BF16_MIN, ["add"])}, CARRIERS, "bfloat16")(view)
    precision = dict(view.nodes(data="precision"))
    assert precision == {"scores": "low", "masked_fill": "fp32", "add": "fp32", "softmax": "fp32", "matmul": "low"}
    assert view.nodes["masked_fill"]["rule"] == beyond_rule("allow", BF16_MIN, "bfloat16")
    assert view.nodes["softmax"]["rule"] == \
        "allow: reads masked_fill's value (the constant -3.40282e+38), beyond bf16's 3.3895e+38: kept fp32"
    # forced, so that a later hook (cast placement) cannot move it back to low
    assert view.nodes["add"]["forced"] == ("fp32", view.nodes["add"]["rule"])


def test_a_source_outside_the_view_starts_at_its_readers():
    # a tensor constant (get_attr) is not painted: its readers are where the path starts
    view = painted_view({"mm": "allow", "add": "allow", "softmax": "allow", "out": "allow"},
                        [("mm", "add"), ("add", "softmax"), ("softmax", "out")])
    what = "the tensor constant bias, which holds -1e+09"
    keep_constant_paths_fp32({"bias": (what, ["add"])}, {"add"}, "float16")(view)
    assert dict(view.nodes(data="precision")) == {"mm": "low", "add": "fp32", "softmax": "fp32", "out": "low"}
    assert view.nodes["add"]["rule"] == f"allow: reads {what}, beyond fp16's 65504: kept fp32"
    assert view.nodes["softmax"]["rule"].startswith(f"allow: reads bias's value ({what})")


def test_a_source_that_is_no_carrier_keeps_only_itself_fp32():
    # a matmul reading the constant: its output no longer holds the magnitude, its readers stay as painted
    view = painted_view(ATTENTION, ATTENTION_EDGES)
    before = snapshot(view)
    keep_constant_paths_fp32({"scores": ("the constant 1e+39", ["masked_fill"])}, CARRIERS, "bfloat16")(view)
    after = snapshot(view)
    assert after["scores"][0] == "fp32"
    assert {n: v for n, v in after.items() if n != "scores"} == {n: v for n, v in before.items() if n != "scores"}


def test_a_reader_the_user_forced_low_stays_low():
    forced = {"softmax": ("low", "user rule: force_low 'softmax'")}
    view = painted_view(ATTENTION, ATTENTION_EDGES, forced)
    keep_constant_paths_fp32({"masked_fill": (BF16_MIN, ["add"])}, CARRIERS, "bfloat16")(view)
    assert view.nodes["softmax"]["precision"] == "low"
    assert view.nodes["softmax"]["rule"] == "user rule: force_low 'softmax'"
    assert view.nodes["add"]["precision"] == "fp32"


def test_a_carrier_the_user_forced_low_stops_the_walk():
    # add is forced low: its output is low, the constant is already lost there, so softmax stays as painted
    forced = {"add": ("low", "user rule: force_low 'add'")}
    view = painted_view(ATTENTION, ATTENTION_EDGES, forced)
    keep_constant_paths_fp32({"masked_fill": (BF16_MIN, ["add"])}, CARRIERS, "bfloat16")(view)
    precision = dict(view.nodes(data="precision"))
    assert precision == {"scores": "low", "masked_fill": "fp32", "add": "low", "softmax": "low", "matmul": "low"}


def test_a_source_the_user_forced_low_starts_no_walk():
    forced = {"masked_fill": ("low", "user rule: force_low 'masked_fill'")}
    view = painted_view(ATTENTION, ATTENTION_EDGES, forced)
    keep_constant_paths_fp32({"masked_fill": (BF16_MIN, ["add"])}, CARRIERS, "bfloat16")(view)
    assert {p for _, p in view.nodes(data="precision")} == {"low"}


def test_without_sources_the_view_is_left_as_painted():
    view = painted_view(ATTENTION, ATTENTION_EDGES)
    before = snapshot(view)
    keep_constant_paths_fp32({}, CARRIERS, "bfloat16")(view)
    assert snapshot(view) == before
