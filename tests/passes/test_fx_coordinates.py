"""fx/coordinates.py: which readers take a value as their data (not as indices), and the hook that keeps the
positions computed from arange fp32 at O2, with the infer/deny ops that read them; an arange read as indices
starts nothing."""
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.coordinates import keep_fx_coordinates_fp32, readers_as_data
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import PrecisionRules


class Warp(nn.Module):
    """RAFT-like: positions from arange, a predicted update added to them, then read by grid_sample."""

    def __init__(self):
        super().__init__()
        self.flow, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        coords = torch.arange(x.shape[-1]).float()
        coords = coords + self.flow(x)
        grid = torch.stack([coords, coords], -1)[:, None] / 2.0 - 1.0
        image = x[:, None, None, :].expand(2, 1, 4, 4)
        return self.out(F.grid_sample(image, grid, align_corners=True)[:, 0, 0])


class Indexing(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)[:, torch.arange(x.shape[-1])] * 2.0 + 1.0


def traced(model):
    gm = fx.symbolic_trace(model)
    canonicalize(gm)
    infer_dtypes(gm, (torch.randn(2, 4),), torch.bfloat16)
    return gm


def test_readers_as_data_tells_data_from_indices():
    gm = traced(Indexing())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert dict(readers_as_data(nodes["arange"])) == {nodes["getitem_1"]: False}   # proj(x)[:, arange]: indices
    assert dict(readers_as_data(nodes["proj"])) == {nodes["getitem_1"]: True}
    gm = traced(Warp())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert dict(readers_as_data(nodes["add"])) == {nodes["stack"]: True}   # an entry of stack's list


def decided(model, hook=True) -> dict:
    gm = traced(model)
    decide_fx_precision(gm, PrecisionRules.build("O2", "bfloat16"),
                        painted=[keep_fx_coordinates_fp32(gm)] if hook else [])
    return {n.name: facts(n) for n in gm.graph.nodes}


def test_positions_from_arange_and_their_sampler_run_fp32_at_o2():
    f = decided(Warp())
    for name in ("add", "stack", "getitem_1", "truediv", "sub"):   # (arange and its .float() are not painted)
        assert f[name]["precision"] == "fp32" and f[name]["rule"].startswith("coordinates: a position computed from "
                                                                              "arange"), (name, f[name])
    assert f["grid_sample"]["precision"] == "fp32"
    assert f["grid_sample"]["rule"].startswith("allow: reads the coordinates sub: a position rounded")
    assert f["flow"]["precision"] == f["out"]["precision"] == "low"   # matmuls reading or making them: low


def test_without_the_hook_o2_paints_them_low():
    f = decided(Warp(), hook=False)
    assert f["add"]["precision"] == f["grid_sample"]["precision"] == "low"


def test_an_arange_used_as_indices_keeps_nothing_fp32():
    with_hook, without = decided(Indexing()), decided(Indexing(), hook=False)
    assert {n: (a.get("precision"), a.get("rule")) for n, a in with_hook.items()} == \
        {n: (a.get("precision"), a.get("rule")) for n, a in without.items()}
    assert with_hook["mul"]["precision"] == "low"
