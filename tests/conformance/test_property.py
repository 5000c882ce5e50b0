"""Property-based: random small models built from ops of the policy table stay valid and close to fp32."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from amp_compiler import convert
from amp_testing import assert_cast_invariants, assert_close_to_fp32, precision_by_op
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.policy.levels import LEVELS

DIM = 8
# op code -> (canonical op, how it transforms (hidden, previous hidden, module, index))
OPS = {
    "linear": ("linear", lambda h, prev, m, i: m.linears[i](h)),
    "relu": ("relu", lambda h, prev, m, i: F.relu(h)),
    "gelu": ("gelu", lambda h, prev, m, i: F.gelu(h)),
    "tanh": ("tanh", lambda h, prev, m, i: torch.tanh(h)),
    "sigmoid": ("sigmoid", lambda h, prev, m, i: torch.sigmoid(h)),
    "softmax": ("softmax", lambda h, prev, m, i: torch.softmax(h, -1)),
    "layer_norm": ("layer_norm", lambda h, prev, m, i: F.layer_norm(h, (DIM,))),
    "residual": ("add", lambda h, prev, m, i: h + prev),
    "scale": ("mul", lambda h, prev, m, i: h * 0.5),
    "exp": ("exp", lambda h, prev, m, i: torch.exp(torch.tanh(h))),
    "center": ("mean", lambda h, prev, m, i: h - h.mean(-1, keepdim=True)),
    "transpose": ("transpose", lambda h, prev, m, i: h.transpose(0, 1).transpose(0, 1)),
    "reshape": ("reshape", lambda h, prev, m, i: h.reshape(-1, DIM)),
    "cat_slice": ("cat", lambda h, prev, m, i: torch.cat([h, prev], -1).narrow(-1, 0, DIM)),
    "matmul": ("matmul", lambda h, prev, m, i: h @ m.linears[i].weight / DIM),
}


class RandomNet(nn.Module):
    def __init__(self, codes):
        super().__init__()
        self.codes = list(codes)
        self.linears = nn.ModuleList(nn.Linear(DIM, DIM) for _ in self.codes)

    def forward(self, x):
        prev, h = x, x
        for i, code in enumerate(self.codes):
            prev, h = h, OPS[code][1](h, prev, self, i)
        return h


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(codes=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       level=st.sampled_from(["O1", "O2", "O3"]), seed=st.integers(0, 2**16))
def test_random_models_are_valid_and_close_to_fp32(codes, dtype, level, seed):
    torch.manual_seed(seed)
    model = RandomNet(codes)
    x = torch.randn(4, DIM)
    gm = convert(model, level, dtype=dtype)
    assert_cast_invariants(gm)
    with torch.no_grad():
        # unit-scale inputs; O2/O3 run exp and norms in low precision too, so their error grows
        assert_close_to_fp32(gm(x), model(x), dtype, data_scale=1.0, loosen=1.0 if level == "O1" else 4.0)
    painted = precision_by_op(gm)
    if level == "O1":  # the table decides: allow ops low, deny ops fp32 (O1 lets mixed-kernel norms follow)
        for op, precisions in painted.items():
            if op in POLICY and POLICY[op].op_class == "allow":
                assert precisions == {"low"}, op
            if op in POLICY and POLICY[op].op_class == "deny" and op not in LEVELS["O1"].mixed_norms:
                assert precisions == {"fp32"}, op
    if level == "O3":  # every computing op is low; data movement may stay with fp32 inputs
        for node in gm.graph.nodes:
            amp = node.meta.get("amp", {})
            if amp.get("precision") is not None and amp["class"] != "clear":
                assert amp["precision"] == "low", node.name
