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
