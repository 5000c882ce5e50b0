"""The format-neutral painting, on hand-built views: each step of the algorithm on its own."""
import networkx as nx
import pytest

from amp_compiler.passes.painting.paint_precision import paint_precision


def view(nodes: dict[str, str], edges: list[tuple[str, str]], forced=None) -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, cls in nodes.items():
        graph.add_node(name, op_class=cls, reason=f"{cls} op", forced=(forced or {}).get(name))
    graph.add_edges_from(edges)
    return graph


def painted(graph) -> dict[str, str]:
    return dict(graph.nodes(data="precision"))


def chain(*names_and_classes):
    nodes = dict(names_and_classes)
    names = list(nodes)
    return view(nodes, list(zip(names, names[1:])))


def test_allow_is_low_and_deny_is_fp32():
    g = chain(("mm", "allow"), ("norm", "deny"))
    counts = paint_precision(g, bf16=False)
    assert painted(g) == {"mm": "low", "norm": "fp32"}
    assert counts == {"low": 1, "fp32": 1}
    assert g.nodes["mm"]["rule"].startswith("allow:") and g.nodes["norm"]["rule"].startswith("deny:")


def test_gap_between_two_allow_ops_is_closed():
    g = chain(("mm1", "allow"), ("bias_add", "infer"), ("gelu", "infer"), ("view", "clear"), ("mm2", "allow"))
    paint_precision(g, bf16=False)
    assert set(painted(g).values()) == {"low"}
    assert "between low-precision ops" in g.nodes["gelu"]["rule"]


def test_deny_spreads_forward_only_into_ops_that_lead_to_fragile_ops():
    # softmax -> mul -> add -> layer_norm: the whole tail stays fp32 (no bounce to low and back).
    g = chain(("softmax", "deny"), ("mul", "infer"), ("add", "infer"), ("norm", "deny"))
    paint_precision(g, bf16=False)
    assert set(painted(g).values()) == {"fp32"}
    assert "fed by fp32 op softmax" in g.nodes["mul"]["rule"]


def test_deny_does_not_spread_into_clear_ops_feeding_only_allow_ops():
    # softmax -> dropout -> matmul: the dropout joins the matmul, one cast sits after the softmax.
    g = chain(("softmax", "deny"), ("dropout", "clear"), ("matmul", "allow"))
    paint_precision(g, bf16=False)
    assert painted(g) == {"softmax": "fp32", "dropout": "low", "matmul": "low"}


def test_infer_after_allow_that_feeds_deny_stays_fp32_in_fp16_but_lowers_in_bf16():
    for bf16, expected in ((False, "fp32"), (True, "low")):
        g = view({"x": "deny", "mm": "allow", "scale": "infer", "out": "allow"},
                 [("mm", "scale")])
        paint_precision(g, bf16=bf16)
        assert g.nodes["scale"]["precision"] == expected


def test_bf16_infer_with_an_fp32_input_stays_fp32():
    g = view({"mm": "allow", "norm": "deny", "add": "infer"}, [("mm", "add"), ("norm", "add")])
    paint_precision(g, bf16=True)
    assert g.nodes["add"]["precision"] == "fp32"


def test_clear_ops_join_their_low_neighbours_in_both_directions():
    g = view({"reshape_in": "clear", "mm": "allow", "reshape_out": "clear", "loose": "clear"},
             [("reshape_in", "mm"), ("mm", "reshape_out")])
    paint_precision(g, bf16=False)
    assert painted(g) == {"reshape_in": "low", "mm": "low", "reshape_out": "low", "loose": "fp32"}


def test_forced_precision_wins_over_the_class():
    g = chain(("mm", "allow"), ("softmax", "deny"))
    g.nodes["mm"]["forced"] = ("fp32", "user rule: force_fp32 'head'")
    g.nodes["softmax"]["forced"] = ("low", "user rule: force_low 'attn'")
    paint_precision(g, bf16=False)
    assert painted(g) == {"mm": "fp32", "softmax": "low"}
    assert g.nodes["mm"]["rule"] == "user rule: force_fp32 'head'"


def test_ignore_nodes_are_not_painted_and_cut_paths():
    g = view({"mm1": "allow", "size": "ignore", "view": "clear", "mm2": "allow"},
             [("mm1", "size"), ("size", "view")])
    paint_precision(g, bf16=False)
    assert "precision" not in g.nodes["size"]
    assert g.nodes["view"]["precision"] == "fp32"  # reached only through a non-float value


@pytest.mark.parametrize("n", [10, 200])
def test_every_paintable_node_gets_a_precision_and_a_rule(n):
    names = {f"n{i}": ("allow", "infer", "deny", "clear")[i % 4] for i in range(n)}
    g = view(names, [(f"n{i}", f"n{i + 1}") for i in range(n - 1)])
    counts = paint_precision(g, bf16=False)
    assert counts["low"] + counts["fp32"] == n
    assert all(g.nodes[x]["rule"] for x in g)
