"""painting/keep_phases_fp32.py on hand-built views: sin/cos run fp32 with the arithmetic, casts and data
movement that compute their argument, back to the first node of another kind; their readers stay as painted."""
import networkx as nx

from amp_compiler.passes.painting.keep_phases_fp32 import keep_phases_fp32
from amp_compiler.passes.painting.paint_precision import paint_precision

# a timestep embedding: freqs = exp(...); phase = (t * freqs) * 2; cat(sin, cos) -> linear
OPS = {"t": "float", "exp": "exp", "mul": "mul", "mul_2": "mul", "sin": "sin", "cos": "cos", "cat": "cat",
       "proj": "linear"}
EDGES = [("t", "mul"), ("exp", "mul"), ("mul", "mul_2"), ("mul_2", "sin"), ("mul_2", "cos"), ("sin", "cat"),
         ("cos", "cat"), ("cat", "proj")]


def painted_view(ops=OPS, edges=EDGES, forced=None) -> nx.DiGraph:
    view = nx.DiGraph()
    for name in ops:
        view.add_node(name, op_class="allow", reason="O2", forced=(forced or {}).get(name))   # O2: all low
    view.add_edges_from(edges)
    paint_precision(view, bf16=True)
    return view


def fp32(view) -> set:
    return {n for n, p in view.nodes(data="precision") if p == "fp32"}


def test_sin_cos_and_the_arithmetic_computing_their_argument_run_fp32():
    view = painted_view()
    keep_phases_fp32(OPS.get)(view)
    # exp is another kind of op (its output is what it is); the cat and the projection read [-1, 1] values
    assert fp32(view) == {"t", "mul", "mul_2", "sin", "cos"}
    assert view.nodes["sin"]["rule"].startswith("phase: sin of an argument computed in fp32")
    assert view.nodes["mul"]["rule"].startswith("phase: computes the argument of ")
    assert view.nodes["mul_2"]["forced"][0] == "fp32"


def test_a_matmul_computing_the_argument_ends_the_walk():
    ops = {"x": "relu", "lin": "linear", "sin": "sin"}
    view = painted_view(ops, [("x", "lin"), ("lin", "sin")])
    keep_phases_fp32(ops.get)(view)
    assert fp32(view) == {"sin"}


def test_a_forced_low_node_stays_low_and_stops_the_walk():
    view = painted_view(forced={"mul_2": ("low", "user rule: force_low 'mul_2'")})
    keep_phases_fp32(OPS.get)(view)
    assert fp32(view) == {"sin", "cos"}   # mul behind the forced mul_2 is not reached
    view = painted_view(forced={"sin": ("low", "user"), "cos": ("low", "user")})
    keep_phases_fp32(OPS.get)(view)
    assert fp32(view) == set()


def test_without_sin_or_cos_the_view_is_left_as_painted():
    ops = {**OPS, "sin": "tanh", "cos": "sigmoid"}
    view = painted_view(ops)
    before = {n: dict(a) for n, a in view.nodes(data=True)}
    keep_phases_fp32(ops.get)(view)
    assert {n: dict(a) for n, a in view.nodes(data=True)} == before
