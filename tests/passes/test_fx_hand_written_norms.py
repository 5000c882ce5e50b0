"""fx/hand_written_norms.py: the fx side of keep_norms_fp32 on traced modules; the nodes of an RMSNorm or a
LayerNorm written as pointwise ops follow the level's norm rule (O2: fp32), Python numbers such as eps and the
exponent are not inputs of the shape, and where the level runs norms low (O3) the painting is left alone."""
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.hand_written_norms import keep_fx_hand_written_norms_fp32
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import PrecisionRules


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LayerNormByHand(nn.Module):
    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return (x - u) / torch.sqrt(s + 1e-5) * 2.0


class MeanSquare(nn.Module):   # pow -> mean -> + eps -> sqrt, but nothing is normalised by it
    def forward(self, x):
        return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 3.0


def decided(model, level="O2", hook=True) -> dict:
    x = torch.randn(2, 8)
    gm = fx.symbolic_trace(model)
    canonicalize(gm)
    infer_dtypes(gm, (x,), torch.float16)
    rules = PrecisionRules.build(level, "float16")
    decide_fx_precision(gm, rules, painted=[keep_fx_hand_written_norms_fp32(gm, rules.norm_kept_fp32())] if hook else [])
    return {n.name: facts(n) for n in gm.graph.nodes if facts(n).get("precision") is not None}


def test_an_rms_norm_runs_fp32_at_o2_and_its_weight_stays_low():
    f = decided(RMSNorm())
    assert {n for n, a in f.items() if a["precision"] == "fp32"} == {"pow_1", "mean", "add", "rsqrt", "mul"}
    assert f["mul_1"]["precision"] == "low"   # self.weight * ...: the affine weight is not the norm's
    assert f["rsqrt"]["rule"].startswith("norm: a hand-written RMSNorm (pow -> mean -> add -> rsqrt -> mul, "
                                         "normalising at mul), kept fp32 as the level keeps norms (")


def test_without_the_hook_o2_runs_it_low():   # the baseline the hook changes
    assert {a["precision"] for a in decided(RMSNorm(), hook=False).values()} == {"low"}


def test_a_layer_norm_by_hand_is_found_with_its_centring():
    f = decided(LayerNormByHand())
    assert {n for n, a in f.items() if a["precision"] == "fp32"} == {"mean", "sub", "sub_1", "pow_1", "mean_1",
                                                                      "add", "sqrt", "truediv"}
    assert "hand-written LayerNorm" in f["sqrt"]["rule"] and f["mul"]["precision"] == "low"


def test_a_chain_that_normalises_nothing_is_no_norm():
    assert {a["precision"] for a in decided(MeanSquare()).values()} == {"low"}


def test_where_the_level_runs_norms_low_the_painting_is_kept():
    with_hook, without = decided(RMSNorm(), "O3"), decided(RMSNorm(), "O3", hook=False)
    assert {n: (a["precision"], a["rule"]) for n, a in with_hook.items()} == \
        {n: (a["precision"], a["rule"]) for n, a in without.items()}
