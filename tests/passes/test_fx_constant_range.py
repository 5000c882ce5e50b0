"""fx/constant_range.py: where the constants beyond the low dtype's range are (Python numbers, tensor
constants; not sizes), which nodes carry a magnitude on, and the FP16RangeWarning where a float16 op reads
one anyway (only a reader the user forced low is left once the path is kept fp32)."""
import warnings

import pytest
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.constant_range import (FP16RangeWarning, constants_beyond_range, magnitude_carriers,
                                                   warn_constants_beyond_fp16)
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_constants_fp32 import keep_constant_paths_fp32
from amp_compiler.passes.policy.rules import PrecisionRules


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.register_buffer("bias", torch.triu(torch.full((4, 4), -1e9), diagonal=1))

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(-1, -2)
        scores = scores.masked_fill(mask, -1e9) + self.bias
        return torch.softmax(scores, -1) @ x


def analysed():
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, 4, dtype=torch.bool)
    gm = fx.symbolic_trace(Masked())
    canonicalize(gm)
    infer_dtypes(gm, (x, mask), torch.float16)
    return gm


def test_the_nodes_that_hold_or_read_a_constant_beyond_fp16_and_their_readers():
    sources = constants_beyond_range(analysed(), torch.float16)
    assert sources == {"bias": ("the tensor constant bias, which holds -1e+09", ["add"]),
                       "masked_fill": ("the constant -1e+09", ["add"])}


def test_bf16_holds_them():
    assert constants_beyond_range(analysed(), torch.bfloat16) == {}


def test_an_integer_size_is_no_constant():
    class Sized(nn.Module):
        def forward(self, x):
            return x.reshape(70000) * 2.0 + 70000   # the size is a shape; the added 70000 is a value
    gm = fx.symbolic_trace(Sized())
    canonicalize(gm)
    infer_dtypes(gm, (torch.randn(70000),), torch.float16)
    assert constants_beyond_range(gm, torch.float16) == {"add": ("the constant 70000", ["output"])}


def test_the_magnitude_carriers_are_the_policys_infer_and_clear_ops():
    carriers = magnitude_carriers(analysed(), torch.float16)
    assert {"masked_fill", "add", "transpose"} <= carriers
    assert not carriers & {"q", "matmul", "softmax", "x", "bias"}


def decided(**options):
    gm = analysed()
    rules = PrecisionRules.build("O1", "float16", **options)
    hook = keep_constant_paths_fp32(constants_beyond_range(gm, torch.float16),
                                    magnitude_carriers(gm, torch.float16), rules.low_dtype)
    decide_fx_precision(gm, rules, painted=[hook])
    return gm


def test_a_reader_forced_low_gets_a_warning_on_the_node_that_reads_the_constant():
    gm = decided(force_low=["softmax"])
    with pytest.warns(FP16RangeWarning) as caught:
        result = warn_constants_beyond_fp16(gm)
    assert result.counts == {"warnings": 2} and len(caught) == 2
    nodes = {n.name: n for n in gm.graph.nodes}
    warning = facts(nodes["masked_fill"])["warning"]
    assert warning.startswith("masked_fill reads the constant -1e+09, beyond fp16's 65504 (it runs fp32); its value "
                              "reaches softmax (softmax) in float16, where it becomes -inf")
    assert "force_fp32=['softmax']" in warning
    assert facts(nodes["bias"])["warning"].startswith("the tensor constant bias holds -1e+09, beyond fp16's 65504;")


def test_when_the_path_is_kept_fp32_no_warning_is_given():
    gm = decided()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FP16RangeWarning)
        assert warn_constants_beyond_fp16(gm).counts == {}
    assert not any("warning" in facts(n) for n in gm.graph.nodes)
