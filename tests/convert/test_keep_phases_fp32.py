"""sin/cos arguments stay fp32 with the arithmetic that computes them (passes/painting/keep_phases_fp32.py):
a timestep embedding (diffusion UNets) computed in bf16 rounds timesteps near 1000 to steps of 4."""
import math

import pytest
import torch
from torch import nn

from amp_compiler import convert
from amp_compiler.passes.node_facts import facts


class TimestepEmbedding(nn.Module):
    """diffusers' get_timestep_embedding, then a projection: integer timesteps in, features out."""

    def __init__(self, half: int = 16):
        super().__init__()
        self.half = half
        self.proj = nn.Linear(2 * half, 8)

    def forward(self, timesteps):
        freqs = torch.exp(-math.log(10000) * torch.arange(self.half, dtype=torch.float32) / self.half)
        phase = timesteps.float()[:, None] * freqs[None, :] * 2.0
        return self.proj(torch.cat([phase.sin(), phase.cos()], dim=-1))


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_phase_of_sin_and_cos_is_computed_in_fp32(level, dtype):
    torch.manual_seed(0)
    model = TimestepEmbedding().eval()
    timesteps = torch.tensor([999, 517, 3, 640])
    gm = convert(model, level, dtype=dtype, example_inputs=(timesteps,))
    decided = {facts(n)["op"]: facts(n) for n in gm.graph.nodes if facts(n).get("op") in ("sin", "cos", "mul")}
    for op in ("sin", "cos", "mul"):
        assert decided[op]["precision"] == "fp32" and decided[op]["rule"].startswith("phase:"), (op, decided[op])
    assert facts(next(n for n in gm.graph.nodes if facts(n).get("op") == "linear"))["precision"] == "low"
    with torch.no_grad():
        reference, output = model(timesteps), gm(timesteps)
    # the projection alone in low precision: a few units of its rounding; a rounded phase gives O(1) errors
    assert (output.float() - reference).abs().max() < 0.02
