"""fx/routing.py: a choice made from scores (topk, argmax) keeps them fp32 back to the router's matmul, an
in-place scatter-add keeps its buffer fp32, token counts stay fp32; everything else stays as painted (O2)."""
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.routing import keep_routing_fp32, routing_scores, scatter_accumulators
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import PrecisionRules


def decided(model, *inputs, routing=True) -> dict:
    gm = fx.symbolic_trace(model)
    canonicalize(gm)
    infer_dtypes(gm, inputs, torch.bfloat16)
    decide_fx_precision(gm, PrecisionRules.build("O2", "bfloat16"), painted=[keep_routing_fp32(gm)] if routing else [])
    return {n.name: facts(n) for n in gm.graph.nodes}


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.expert = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        weights, chosen = self.router(x).softmax(-1).topk(2)
        return self.expert(x) * weights.sum(-1, keepdim=True), chosen


def test_the_choice_its_scores_and_the_router_run_fp32_and_the_expert_stays_low():
    f = decided(Router(), torch.randn(3, 8))
    for name in ("router", "softmax", "topk", "getitem", "getitem_1"):
        assert f[name]["precision"] == "fp32" and f[name]["rule"].startswith("routing: "), (name, f[name])
    assert f["topk"]["rule"].startswith("routing: the choice: ")
    assert f["softmax"]["rule"].startswith("routing: a score topk (topk) chooses from")
    assert f["expert"]["precision"] == f["mul"]["precision"] == "low"


def test_without_the_hook_o2_paints_the_router_low():   # the baseline the hook changes
    f = decided(Router(), torch.randn(3, 8), routing=False)
    assert f["router"]["precision"] == f["softmax"]["precision"] == f["topk"]["precision"] == "low"


class Projection(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.proj, self.shared = nn.Linear(8, 4), shared

    def forward(self, x):
        h = self.proj(x)
        return (h * 2.0 if self.shared else x * 2.0), h.argmax(-1)


def test_a_matmul_whose_output_is_also_data_is_no_router():
    assert decided(Projection(shared=False), torch.randn(3, 8))["proj"]["precision"] == "fp32"   # scores only
    f = decided(Projection(shared=True), torch.randn(3, 8))   # h * 2.0 reads it too
    assert f["proj"]["precision"] == f["mul"]["precision"] == "low"


class TopValues(nn.Module):
    """Max pooling by topk: the values are used, the indices are not; no choice is made."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).softmax(-1).topk(2).values.sum(-1)


def test_a_topk_whose_indices_are_unused_is_no_choice_and_nothing_changes():
    x = torch.randn(3, 8)
    with_hook, without = decided(TopValues(), x), decided(TopValues(), x, routing=False)
    assert {n: (f["precision"], f["rule"]) for n, f in with_hook.items()} == \
        {n: (f["precision"], f["rule"]) for n, f in without.items()}
    assert with_hook["topk"]["precision"] == "low"


class ScatterAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.expert = nn.Linear(8, 8)

    def forward(self, x, token):
        out = torch.zeros_like(x)
        out.index_add_(0, token, self.expert(x))
        return out, torch.histc(x, bins=4)


def test_the_buffer_a_scatter_add_writes_and_token_counts_stay_fp32():
    x, token = torch.randn(3, 8), torch.tensor([0, 2, 0])
    f = decided(ScatterAdd(), x, token)
    assert f["zeros_like"]["precision"] == "fp32"
    assert f["zeros_like"]["rule"].startswith("accumulator: index_add_ (index_add) adds into it in place")
    assert f["histc"]["precision"] == "fp32" and f["histc"]["rule"].startswith("counts: ")
    assert f["expert"]["precision"] == "low"
    assert f["index_add_"]["class"] == "ignore"   # the write itself is set aside (it runs in the buffer's dtype)


def test_the_analyses_on_their_own():
    gm = fx.symbolic_trace(ScatterAdd())
    canonicalize(gm)
    infer_dtypes(gm, (torch.randn(3, 8), torch.tensor([0, 2, 0])), torch.bfloat16)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert scatter_accumulators(gm.graph.nodes) == {nodes["zeros_like"]: nodes["index_add_"]}
    assert routing_scores(gm.graph.nodes) == {}
