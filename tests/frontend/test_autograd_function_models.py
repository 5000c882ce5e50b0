"""Models whose forward calls a custom torch.autograd.Function: it stays one node whose own backward runs.

`Fn.apply(x)` was kept whole, but an alias bound at import (`ste_round = RoundSTE.apply`, as much model code
writes it) called the original apply: fx traced its forward as plain ops (the backward lost: a straight-through
estimator's gradients came out zero), torch.export inlined it without a word, and a forward fx cannot trace
(numpy inside) made the whole model run as written.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.frontend import TracingError
from amp_testing import assert_close_to_fp32


class RoundSTE(torch.autograd.Function):
    """Rounds in forward; its backward passes the gradient straight through (round's own is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class NumpyGeLU(torch.autograd.Function):
    """A GeLU written as a Function whose forward leaves torch (fx and torch.export cannot trace it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        erf = np.vectorize(math.erf)(x.detach().cpu().numpy() / math.sqrt(2))
        return 0.5 * x * (1 + torch.from_numpy(erf).to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return grad * (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))


ste_round = RoundSTE.apply    # aliases bound before any capture: they hold the original apply
numpy_gelu = NumpyGeLU.apply


class MLP(nn.Module):
    def __init__(self, activation, branch: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.activation, self.branch = activation, branch

    def forward(self, x):
        h = self.activation(self.fc1(x) * 4)
        if self.branch and h.shape[0] > 1:   # fx fails at the top; torch.export captures it
            h = h - 1
        return self.fc2(h)


def _forward_and_grads(model, x):
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), model.fc1.weight.grad.clone()


@pytest.mark.parametrize("branch", [False, True], ids=["fx", "torch_export_fallback"])
def test_an_aliased_function_keeps_its_own_backward(branch):
    torch.manual_seed(0)
    model, x = MLP(ste_round, branch), torch.randn(4, 16)
    converted = amp_compiler.convert(model, "O1", example_inputs=(x,))
    expected_out, expected_grad = _forward_and_grads(model, x)
    out, grad = _forward_and_grads(converted, x)
    assert expected_grad.abs().sum() > 0
    assert_close_to_fp32(grad, expected_grad, torch.float16, loosen=2)   # was all zeros: round's own gradient
    assert_close_to_fp32(out, expected_out, torch.float16, loosen=4)     # rounding: off by one step at worst


def test_a_function_fx_cannot_trace_into_is_one_opaque_node_and_explained():
    torch.manual_seed(0)
    model, x = MLP(numpy_gelu), torch.randn(4, 16)
    converted = amp_compiler.convert(model, "O1", example_inputs=(x,))
    assert converted.meta["amp"]["frontend"] == "fx.symbolic_trace"   # was: as written, children converted
    report = str(amp_compiler.explain(converted))
    assert "custom autograd.Function NumpyGeLU: kept whole so its own backward runs" in report
    expected_out, expected_grad = _forward_and_grads(model, x)
    out, grad = _forward_and_grads(converted, x)
    assert_close_to_fp32(out, expected_out, torch.float16)
    assert_close_to_fp32(grad, expected_grad, torch.float16)


def test_export_onnx_of_a_function_torch_export_cannot_trace_fails_in_one_line(tmp_path):
    model, x = MLP(lambda h: NumpyGeLU.apply(h)).eval(), torch.randn(4, 16)
    with pytest.raises(TracingError) as failure:
        amp_compiler.export_onnx(model, (x,), tmp_path / "mlp.onnx")
    message = str(failure.value)
    assert "\n" not in message
    assert "custom autograd.Function NumpyGeLU" in message and ".numpy()" in message
    assert "custom_translation_table" in message   # what to do
