"""painting/keep_upcasts_fp32.py on a graph of names: from the model's own upcast, the walk takes every reader
that computes on the fp32 value (not a matmul, not an unpainted op) up to the model's cast back, inside the
module that wrote the upcast; the hook keeps that region fp32 on the painted view."""
import networkx as nx

from amp_compiler.passes.painting.keep_upcasts_fp32 import keep_upcasts_fp32, upcast_regions
from amp_compiler.passes.painting.paint_precision import paint_precision
from amp_compiler.passes.policy.numerics import USER_CASTS

# LlamaRMSNorm-like: up = h.float(); pow -> mean -> add -> rsqrt -> mul(up, rsqrt); back = mul.to(h.dtype); linear
OPS = {"h": "linear", "up": "float", "pow": "pow", "mean": "mean", "add": "add", "rsqrt": "rsqrt", "mul": "mul",
       "back": "to", "lin": "linear", "after": "relu"}
EDGES = [("h", "up"), ("up", "pow"), ("pow", "mean"), ("mean", "add"), ("add", "rsqrt"), ("up", "mul"),
         ("rsqrt", "mul"), ("mul", "back"), ("back", "lin"), ("lin", "after")]
MODULE = {n: "layer.norm" for n in ("up", "pow", "mean", "add", "rsqrt", "mul", "back")}


def graph(edges=EDGES) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(OPS)
    g.add_edges_from(edges)
    return g


def regions(g, upcasts=("up",), module=lambda n: MODULE.get(n, "layer"), op=OPS.get):
    return upcast_regions(list(upcasts), g.successors, op, lambda n: op(n) in USER_CASTS, module)


def test_the_ops_computing_on_the_upcast_value_belong_to_it_up_to_the_cast_back():
    assert regions(graph()) == {n: "up" for n in ("pow", "mean", "add", "rsqrt", "mul")}


def test_a_matmul_reading_the_upcast_ends_the_walk():
    g = graph([("up", "lin"), ("lin", "after")])   # a matmul runs low on an fp32 input (autocast too)
    assert regions(g, module=lambda n: "") == {}


def test_the_walk_stays_inside_the_module_that_wrote_the_cast():
    g = graph(EDGES + [("up", "after")])   # the residual add of the layer reads the norm's upcast
    found = regions(g)
    assert "after" not in found and "mul" in found
    assert "after" in regions(g, module=lambda n: "")   # with one scope for all, it is inside


def test_a_cast_back_starts_no_walk_of_its_own():
    # captured at fp32, the cast back `.to(input_dtype)` is a .to(float32) too: listed as an upcast after `up`
    ops = {**OPS, "lin": "tanh"}   # so that a walk from `back` would find a reader
    found = regions(graph(), upcasts=("up", "back"), op=ops.get, module=lambda n: "")
    assert "lin" not in found and found["mul"] == "up"
    assert regions(graph(), upcasts=("back",), op=ops.get, module=lambda n: "")["lin"] == "back"   # alone, it would


def painted_view(forced=None) -> nx.DiGraph:
    """O2: every op allow, all low."""
    view = nx.DiGraph()
    for name in ("h", "pow", "mean", "add", "rsqrt", "mul", "lin", "after"):   # casts are ignore: not painted
        view.add_node(name, op_class="allow", reason="O2", forced=(forced or {}).get(name))
    view.add_edges_from((a, b) for a, b in EDGES if a in view and b in view)
    paint_precision(view, bf16=False)
    return view


def hook(upcasts=("up",)):
    return keep_upcasts_fp32(list(upcasts), graph().successors, OPS.get, lambda n: OPS[n] in USER_CASTS,
                             lambda n: MODULE.get(n, "layer"), lambda n: ".float()")


def test_the_hook_keeps_the_region_fp32_and_names_the_upcast():
    view = painted_view()
    hook()(view)
    precision = dict(view.nodes(data="precision"))
    assert {n for n, p in precision.items() if p == "fp32"} == {"pow", "mean", "add", "rsqrt", "mul"}
    assert precision["h"] == precision["lin"] == precision["after"] == "low"
    assert view.nodes["rsqrt"]["rule"].startswith("upcast: the model's own .float() at up: computes on its fp32 value")
    assert view.nodes["rsqrt"]["forced"][0] == "fp32"


def test_an_fp32_node_no_rule_forced_is_relabelled_and_a_forced_low_one_stays_low():
    view = painted_view(forced={"mean": ("low", "user rule: force_low 'mean'")})
    view.nodes["pow"].update(precision="fp32", rule="deny: O1's pow")   # fp32 already, by the policy
    hook()(view)
    assert view.nodes["pow"]["rule"].startswith("upcast:")
    assert (view.nodes["mean"]["precision"], view.nodes["mean"]["rule"]) == ("low", "user rule: force_low 'mean'")
    assert view.nodes["add"]["precision"] == "fp32"


def test_without_an_upcast_the_view_is_left_as_painted():
    view = painted_view()
    before = dict(view.nodes(data=True))
    before = {n: dict(a) for n, a in before.items()}
    hook(upcasts=())(view)
    assert {n: dict(a) for n, a in view.nodes(data=True)} == before
