"""The policy table is data: validated at load, one reason per entry, overlays only retarget."""
import pytest

from amp_compiler.passes.policy import op_policy
from amp_compiler.passes.policy.op_policy import BF16_OVERLAY, CLASSES, POLICY, OpRule, default_lists, policy_for


def test_every_entry_has_a_known_class_a_family_and_a_reason():
    for op, rule in POLICY.items():
        assert rule.op == op and rule.op_class in CLASSES and rule.family and len(rule.reason) > 15


def test_seed_lists_are_classified_as_the_design_card_says():
    for op in ("linear", "matmul", "bmm", "conv2d", "conv_transpose2d", "einsum", "scaled_dot_product_attention",
               "prelu", "lstm"):
        assert POLICY[op].op_class == "allow", op
    for op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm", "softmax", "log_softmax",
               "cross_entropy", "mse_loss", "exp", "log", "pow", "sum", "prod", "cumsum", "logsumexp", "norm",
               "rsqrt", "reciprocal", "cdist", "interpolate"):
        assert POLICY[op].op_class == "deny", op
    for op in ("add", "mul", "gelu", "sigmoid", "tanh"):
        assert POLICY[op].op_class == "infer", op
    for op in ("view", "reshape", "transpose", "cat", "slice", "relu", "max", "dropout"):
        assert POLICY[op].op_class == "clear", op


def test_an_op_listed_twice_is_rejected_when_the_table_loads():
    with pytest.raises(ValueError, match="'exp' is listed twice"):
        op_policy._build([OpRule("exp", "deny", "x", "r"), OpRule("exp", "infer", "x", "r")])
    with pytest.raises(ValueError, match="unknown class"):
        op_policy._build([OpRule("exp", "sometimes", "x", "r")])


def test_bf16_overlay_only_relaxes_known_ops_and_keeps_fp16_untouched():
    fp16, bf16 = policy_for("float16"), policy_for("bfloat16")
    for op, (cls, reason) in BF16_OVERLAY.items():
        assert op in POLICY and fp16[op].op_class == "deny" and bf16[op].op_class == cls == "infer"
        assert bf16[op].reason == reason
    assert fp16 == dict(POLICY)


def test_default_lists_are_sorted_views_of_the_table():
    allow = default_lists("allow")
    assert allow == sorted(allow) and "linear" in allow and "softmax" not in allow
    assert "pow" in default_lists("deny", "float16") and "pow" not in default_lists("deny", "bfloat16")


def test_an_average_runs_low_without_overflowing_where_a_sum_stays_fp32():
    """mean is an infer op: its value cannot exceed its inputs', and torch's kernels sum fp16 inputs in fp32,
    so 100,000 values near 1,000 (a sum of 1e8, far past fp16's 65504) average correctly in fp16. sum, whose
    value does overflow, stays fp32."""
    import torch
    from torch import nn

    import amp_compiler

    class Pools(nn.Module):
        """Identity linears: the mean sits between low ops (a squeeze-excite block's shape) and reads ~1,000."""

        def __init__(self):
            super().__init__()
            self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 4)
            with torch.no_grad():
                for linear in (self.proj, self.head):
                    linear.weight.copy_(torch.eye(4))
                    linear.bias.zero_()

        def forward(self, x):
            h = self.proj(x)
            return self.head(h.mean(1)), self.head(h.sum(1) / h.shape[1])

    x = 1000 + torch.rand(2, 100_000, 4)
    gm = amp_compiler.convert(Pools(), "O1", dtype=torch.float16, example_inputs=(x,))
    precision = {n.meta["amp"].get("op"): n.meta["amp"].get("precision") for n in gm.graph.nodes}
    assert precision["mean"] == "low" and precision["sum"] == "fp32"
    mean, by_sum = gm(x)
    expected = x.half().double().mean(1)   # the inputs as fp16 holds them
    assert mean.dtype == torch.float32   # keep_io_types: the graph's outputs keep the model's dtype
    torch.testing.assert_close(mean.double(), expected, rtol=1e-3, atol=0)   # fp16 rounding of the result only
    torch.testing.assert_close(by_sum.double(), expected, rtol=1e-5, atol=0)


def test_onnx_runtime_averages_fp16_in_fp32_as_the_average_rule_assumes():
    """The "average" rule holds for the exported ONNX too: ORT's fp16 ReduceMean sums in fp32."""
    import numpy as np
    from onnx import TensorProto, helper

    from amp_compiler.onnx.sessions import make_session

    graph = helper.make_graph([helper.make_node("ReduceMean", ["x"], ["y"], keepdims=0)], "average",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [100_000])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = (1000 + np.random.default_rng(0).random(100_000)).astype(np.float16)   # a sum of 1e8
    (y,) = make_session(model.SerializeToString()).run(None, {"x": x})
    assert np.isfinite(y) and abs(float(y) - x.astype(np.float64).mean()) < 1.0   # fp16 spacing at 1,000 is 0.5
