"""fx/opaque_calls.py: plan_opaque_calls runs each opaque body (here a custom autograd.Function the front end
keeps whole) under autocast with the level's low dtype and returns its float outputs in the dtype the model
produced; without a low dtype, or in a graph with no opaque call, nothing changes."""
import torch
from torch import nn

from amp_compiler.frontend import trace
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.opaque_calls import AS_WRITTEN, is_opaque_call, plan_opaque_calls
from amp_compiler.passes.fx.propagate_values import propagate_values
from amp_compiler.passes.node_facts import facts


class Gram(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x @ x.t()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


class Argmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.argmax(-1)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


class Model(nn.Module):
    def __init__(self, function=Gram):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x) + 1


def traced(model, x):
    gm = trace(model, (x,)).graph_module
    canonicalize(gm)
    propagate_values(gm, (x,))   # as the fx pipeline does before infer_dtypes: the body's output dtype is known
    infer_dtypes(gm, (x,), torch.bfloat16)
    return gm, next(n for n in gm.graph.nodes if is_opaque_call(n))


def test_the_body_runs_under_autocast_and_returns_the_models_dtype():
    x = torch.randn(3, 16)
    gm, call = traced(Model(), x)
    assert call.args[1] == AS_WRITTEN   # as traced
    result = plan_opaque_calls(gm, torch.bfloat16)
    assert result.modified and result.counts == {"opaque_calls": 1}
    assert call.args[1] == (torch.bfloat16, torch.float32) and call.args[2].name == "x"   # input uncast
    assert facts(call)["rule"] == ("opaque (custom autograd.Function Gram: kept whole so its own backward runs): "
                                   "runs under torch.autocast(bfloat16), inputs uncast")
    gm.recompile()
    out = gm(x)
    assert out.dtype == torch.float32
    low = (x.bfloat16() @ x.t().bfloat16()).float() + 1   # the matmul ran bf16 inside
    assert torch.equal(out, low) and not torch.equal(out, x @ x.t() + 1)


def test_an_integer_output_is_returned_as_the_body_makes_it():
    gm, call = traced(Model(Argmax), torch.randn(3, 16))
    plan_opaque_calls(gm, torch.bfloat16)
    assert call.args[1] == (torch.bfloat16, None)


def test_without_a_low_dtype_the_body_runs_as_written():
    x = torch.randn(3, 16)
    gm, call = traced(Model(), x)
    assert plan_opaque_calls(gm, None).counts == {"opaque_calls": 1}
    assert call.args[1] == AS_WRITTEN and facts(call)["rule"].endswith("runs as written, inputs uncast")
    gm.recompile()
    assert torch.equal(gm(x), x @ x.t() + 1)


def test_a_graph_without_opaque_calls_is_left_unchanged():
    gm = trace(nn.Linear(4, 4), (torch.randn(2, 4),)).graph_module
    code = gm.code
    result = plan_opaque_calls(gm, torch.bfloat16)
    assert not result.modified and result.counts == {"opaque_calls": 0}
    gm.recompile()
    assert gm.code == code and not any("rule" in facts(n) for n in gm.graph.nodes)
