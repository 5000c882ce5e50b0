"""The decide step both IRs share (passes/painting/decide.py): one outline, an adapter per IR, and a hook
that sees the painted view before the precisions are written back."""
import torch

from amp_compiler.frontend import trace
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_testing import LinearNormNet


def _analysed():
    x = torch.randn(2, 8)
    gm = trace(LinearNormNet(), (x,)).graph_module
    canonicalize(gm)
    infer_dtypes(gm, (x,), torch.float16)
    return gm


def test_a_painted_hook_sees_the_painted_view_before_the_write_back():
    gm, seen = _analysed(), {}

    def hook(view):
        seen.update(view.nodes(data="precision"))
        assert all(node.meta["amp"].get("precision") is None for node in gm.graph.nodes)   # not written yet

    result = decide_fx_precision(gm, PrecisionRules.build("O1", "float16"), painted=[hook])
    assert seen == {n.name: n.meta["amp"]["precision"] for n in gm.graph.nodes if n.name in seen}
    assert seen["fc"] == "low" and seen["softmax"] == "fp32"
    assert result.counts == {"low": sum(p == "low" for p in seen.values()), "fp32": sum(p == "fp32" for p in seen.values())}


def test_nodes_outside_the_view_keep_no_precision_and_say_why():
    gm = _analysed()
    decide_fx_precision(gm, PrecisionRules.build("O1", "float16"))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert placeholder.meta["amp"]["class"] == "io" and placeholder.meta["amp"]["precision"] is None
    assert placeholder.meta["amp"]["rule"] == "graph input/output/parameter"
