"""Mixture-of-experts routing (issue 18, passes/fx/routing.py): the scores a top-k chooses experts from, and
the buffer index_add_ accumulates expert outputs into, stay fp32 at every level.

HF Mixtral at O1 fp16 had a token routed to another expert than fp32's: output error 0.037 against
autocast's 0.0004 (a router rounded to fp16). With the router's matmul, softmax and top-k fp32 the choice is
fp32's whenever the router reads fp32 activations (O1: after a norm).
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler import convert
from amp_compiler.passes.node_facts import facts
from amp_testing import AtenDtypeRecorder

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
LOW = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]


class Experts(nn.Module):
    def __init__(self, dim: int, hidden: int, count: int):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                     for _ in range(count))


class SoftmaxTopKMoE(Experts):
    """transformers v4 Mixtral: softmax router, top-2, index_add_ (or index_put_ with accumulate) per expert."""

    def __init__(self, dim=16, hidden=32, count=8, top=2, accumulate="index_add"):
        super().__init__(dim, hidden, count)
        self.norm, self.router, self.top, self.accumulate = nn.LayerNorm(dim), nn.Linear(dim, count, bias=False), top, accumulate

    def route(self, h):
        weights, chosen = torch.topk(F.softmax(self.router(h), dim=-1), self.top, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), chosen

    def forward(self, x):
        h = self.norm(x)
        weights, chosen = self.route(h)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            y = (expert(h[token]) * weights[token, slot, None]).to(out.dtype)
            if self.accumulate == "index_add":
                out.index_add_(0, token, y)
            else:
                out.index_put_((token,), y, accumulate=True)
        return x + out, chosen


class SigmoidRouterMoE(SoftmaxTopKMoE):
    """DeepSeek-V3 style: sigmoid scores plus a bias, top-k of them (no softmax for the policy to deny)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("bias", torch.linspace(-0.01, 0.01, len(self.experts)))

    def route(self, h):
        scores = torch.sigmoid(self.router(h))
        chosen = torch.topk(scores + self.bias, self.top, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return weights / weights.sum(dim=-1, keepdim=True), chosen


def _model(cls, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kwargs).eval()


def _tokens(count: int = 512) -> torch.Tensor:
    return torch.randn(count, 16, generator=torch.Generator().manual_seed(1)) * 3


def _by_op(gm: fx.GraphModule, op: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if facts(n).get("op") == op]


@pytest.mark.slow
@pytest.mark.parametrize("low", LOW)
@pytest.mark.parametrize("cls", [SoftmaxTopKMoE, SigmoidRouterMoE])
def test_the_choice_is_fp32s_at_o1(cls, low):
    """The router reads the fp32 norm: with its matmul and scores fp32, every token goes to fp32's experts.
    Rounded to the low dtype, near-tied scores of 512 tokens x 8 experts swap for some tokens."""
    model = _model(cls)
    x = _tokens()
    gm = convert(model, "O1", dtype=low, example_inputs=(x,))
    router = [n for n in _by_op(gm, "linear") if facts(n).get("module") == "router"]
    assert [facts(n)["precision"] for n in router] == ["fp32"], [facts(n).get("rule") for n in router]
    assert facts(router[0])["rule"].startswith("routing:")
    for node in _by_op(gm, "topk"):
        assert facts(node)["precision"] == "fp32", facts(node)["rule"]
    with torch.no_grad():
        reference, chosen = model(x)
        out, ours = gm(x)
    assert torch.equal(ours, chosen), f"{int((ours != chosen).any(-1).sum())} of {len(x)} tokens routed elsewhere"
    assert (out - reference).abs().max() < 0.05
    expert = [n for n in _by_op(gm, "linear") if facts(n).get("module", "").startswith("experts")]
    assert expert and all(facts(n)["precision"] == "low" for n in expert), "the experts' matmuls run low"


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", ["index_add", "index_put"])
def test_scatter_add_accumulates_in_fp32_at_o2(accumulate):
    """O2 runs everything low, but the zeros_like buffer the experts' outputs are added into stays fp32:
    the in-place scatter-add runs in the buffer's dtype (recorded at run time)."""
    model = _model(SoftmaxTopKMoE, accumulate=accumulate)
    x = _tokens(64)
    gm = convert(model, "O2", dtype=BF16, example_inputs=(x,))
    (buffer,) = _by_op(gm, "zeros_like")
    assert facts(buffer)["precision"] == "fp32" and facts(buffer)["rule"].startswith("accumulator:"), facts(buffer)
    recorder = AtenDtypeRecorder()
    with torch.no_grad(), recorder:
        gm(x)
    amp_compiler.verify(gm, x)   # y.to(out.dtype) is recorded as the fp32 the buffer now is
    kernel = "index_add_" if accumulate == "index_add" else "index_put_"
    assert recorder.calls[kernel] and set(recorder.calls[kernel]) == {(FP32, FP32)}, recorder.calls[kernel]
    experts = {facts(n)["precision"] for n in _by_op(gm, "linear") if facts(n)["module"].startswith("experts")}
    assert experts == {"low"}, "the experts' matmuls still run low"


@pytest.mark.slow
def test_o2_routes_from_fp32_scores():
    """O2 lowers softmax; the routing scores and the choice stay fp32, so a top-k never meets two scores bf16
    made equal (0.2510 and 0.2515 are one bf16 number)."""
    model = _model(SoftmaxTopKMoE)
    x = _tokens(64)
    gm = convert(model, "O2", dtype=BF16, example_inputs=(x,))
    for op in ("softmax", "topk"):
        (node,) = _by_op(gm, op)
        assert facts(node)["precision"] == "fp32" and facts(node)["rule"].startswith("routing:"), facts(node)
    recorder = AtenDtypeRecorder()
    with torch.no_grad(), recorder:
        gm(x)
    assert set(recorder.calls["topk"]) == {(FP32,)} and set(recorder.calls["_softmax"]) == {(FP32,)}


class SharedScores(nn.Module):
    """A top-k over activations that also go on to the next layer: not a router, the matmul stays low."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.proj(x)
        return self.head(h), torch.topk(h, 4, dim=-1).indices


def test_a_matmul_with_other_readers_stays_low():
    model = _model(SharedScores)
    x = _tokens(8)
    gm = convert(model, "O1", dtype=BF16, example_inputs=(x,))
    (proj,) = [n for n in _by_op(gm, "linear") if facts(n).get("module") == "proj"]
    assert facts(proj)["precision"] == "low", facts(proj)["rule"]
    (topk,) = _by_op(gm, "topk")
    assert facts(topk)["precision"] == "fp32" and facts(topk)["rule"].startswith("routing:")


class ExpertOffsets(nn.Module):
    """transformers' grouped experts: tokens per expert counted with histc (CPU wants floats), the offsets of
    each expert's group made with cumsum(dtype=int32)."""

    def forward(self, expert_ids, x):
        counts = torch.histc(expert_ids.float(), bins=4, min=0, max=3)
        return torch.cumsum(counts, dim=0, dtype=torch.int32), x * 2


def test_counts_of_tokens_per_expert_stay_exact_at_o2():
    """301 tokens for expert 0: not a bf16 number (bf16 steps by 2 from 256), so O2's bf16 histc or a bf16
    read of the counts made the offsets 300, 305: a silently wrong split of the tokens among the experts."""
    expert_ids = torch.cat([torch.zeros(301, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    x = torch.randn(4)
    gm = convert(ExpertOffsets(), "O2", dtype=BF16, example_inputs=(expert_ids, x))
    offsets, _ = gm(expert_ids, x)
    assert offsets.tolist() == [301, 306, 306, 306]
    for op in ("histc", "cumsum"):
        (node,) = _by_op(gm, op)
        assert facts(node)["precision"] == "fp32" and facts(node)["rule"].startswith("counts:"), facts(node)
