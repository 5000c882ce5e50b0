"""painting/keep_norms_fp32.py on hand-built views: a norm written as pointwise ops is found by its shape
(square -> mean -> + eps -> root -> normalising mul/div; a centring x - mean(x) makes it a LayerNorm) and
follows the level's norm rule; other chains of the same ops are left alone."""
import networkx as nx

from amp_compiler.passes.painting.keep_norms_fp32 import hand_written_norms, keep_hand_written_norms_fp32
from amp_compiler.passes.painting.paint_precision import paint_precision

NORM_RULE = "O2: keep_batchnorm_fp32"

# name -> (op, the names of the nodes whose tensors it reads); "x" and "weight" are outside the view
RMS = {"pow": ("pow", ["x"]), "mean": ("mean", ["pow"]), "add": ("add", ["mean"]), "rsqrt": ("rsqrt", ["add"]),
       "mul": ("mul", ["x", "rsqrt"]), "mul_1": ("mul", ["weight", "mul"])}
LAYER = {"mean_u": ("mean", ["x"]), "sub": ("sub", ["x", "mean_u"]), "pow": ("pow", ["sub"]),
         "mean": ("mean", ["pow"]), "add": ("add", ["mean"]), "sqrt": ("sqrt", ["add"]),
         "div": ("div", ["sub", "sqrt"]), "mul": ("mul", ["weight", "div"])}


def view_of(graph: dict, forced=None) -> nx.DiGraph:
    view = nx.DiGraph()
    for name in graph:
        view.add_node(name, op_class="allow", reason="O2", forced=(forced or {}).get(name))   # O2: all low
    view.add_edges_from((i, name) for name, (_, inputs) in graph.items() for i in inputs if i in graph)
    paint_precision(view, bf16=False)
    return view


def found(graph: dict) -> dict:
    return hand_written_norms(view_of(graph), lambda n: graph[n][0], lambda n: graph[n][1])


def test_an_rms_norm_is_its_statistic_and_normaliser_not_its_weight():
    norms = found(RMS)
    assert set(norms) == {"pow", "mean", "add", "rsqrt", "mul"}
    assert norms["add"] == ("RMSNorm", ["pow", "mean", "add", "rsqrt", "mul"])


def test_x_times_x_is_a_square_too():
    graph = {**RMS, "pow": ("mul", ["x", "x"])}
    assert found(graph)["pow"][0] == "RMSNorm"


def test_a_centring_makes_it_a_layer_norm_with_the_centre_in_it():
    norms = found(LAYER)
    assert norms["sub"] == ("LayerNorm", ["mean_u", "sub", "pow", "mean", "add", "sqrt", "div"])
    assert "mul" not in norms


def test_chains_that_are_not_norms_are_not_found():
    loss = {"pow": ("pow", ["x"]), "mean": ("mean", ["pow"])}                                  # a mean squared error
    unnormalised = {**RMS, "mul": ("linear", ["x", "rsqrt"])}                                  # the root feeds no mul/div
    divided = {**RMS, "add": ("div", ["mean", "y"])}                                            # x / y is no step
    no_root = {"pow": ("pow", ["x"]), "mean": ("mean", ["pow"]), "add": ("add", ["mean"]),
               "mul": ("mul", ["x", "add"])}                                                    # never rooted
    for graph in (loss, unnormalised, divided, no_root):
        assert found(graph) == {}, graph


def hook(graph, norm_rule=NORM_RULE):
    return keep_hand_written_norms_fp32(lambda n: graph[n][0], lambda n: graph[n][1], norm_rule)


def test_the_hook_keeps_the_norm_fp32_with_its_shape_and_the_levels_rule():
    view = view_of(RMS)
    hook(RMS)(view)
    assert {n for n, p in view.nodes(data="precision") if p == "fp32"} == {"pow", "mean", "add", "rsqrt", "mul"}
    assert view.nodes["mul_1"]["precision"] == "low"
    assert view.nodes["rsqrt"]["rule"] == ("norm: a hand-written RMSNorm (pow -> mean -> add -> rsqrt -> mul, "
                                           f"normalising at mul), kept fp32 as the level keeps norms ({NORM_RULE})")


def test_a_norm_node_forced_low_stays_low():
    view = view_of(RMS, forced={"rsqrt": ("low", "user rule: force_low 'rsqrt'")})
    hook(RMS)(view)
    assert view.nodes["rsqrt"]["precision"] == "low" and view.nodes["mean"]["precision"] == "fp32"


def test_where_the_level_runs_norms_low_the_view_is_left_as_painted():
    view = view_of(RMS)
    before = {n: dict(a) for n, a in view.nodes(data=True)}
    hook(RMS, norm_rule=None)(view)
    assert {n: dict(a) for n, a in view.nodes(data=True)} == before
