"""A constant the low dtype cannot hold (torch.finfo(torch.float32).min, -1e9 in fp16) keeps its value's path
fp32 at every level and in both low dtypes: the node that reads it and the nodes its value reaches through
pointwise and data-movement ops, up to the first reader that no longer carries it (a softmax). In bf16 a
masked_fill of -3.4e38 raises ("cannot be converted to type c10::BFloat16 without overflow"); a cast makes
it -inf, and a fully masked softmax row NaN where fp32 gives a uniform row (HF DeBERTa-v2 at O2 bf16)."""
import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import compare, convert, explain

F32_MIN = torch.finfo(torch.float32).min          # -3.4028e38: beyond bf16's 3.3895e38 and fp16's 65504
CONFIGS = [("O1", torch.bfloat16), ("O2", torch.bfloat16), ("O2", torch.float16), ("O1", torch.float16)]


class FinfoMaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)).masked_fill(mask, F32_MIN)
        return torch.softmax(scores, -1) @ x


class FinfoAddedMask(FinfoMaskedAttention):
    """(1 - keep) * finfo.min added to the scores (HF BERT's eager extended mask)."""

    def forward(self, x, keep):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) + (1.0 - keep) * F32_MIN
        return torch.softmax(scores, -1) @ x


class FinfoBufferMask(FinfoMaskedAttention):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.triu(torch.full((4, 4), F32_MIN), diagonal=1))

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) + self.bias, -1) @ x


class BucketedPositions(nn.Module):
    """DeBERTa-v2's log-bucketed relative positions: int64 / int divides in float32 whatever the level."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        relative = (positions[None, :] - positions[:, None]).abs().clamp(min=1)
        buckets = torch.ceil(torch.log(relative / 2) * 3).clamp(0, 15).long()
        return x + self.embed(buckets).mean(1)


def inputs():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = True                         # a fully masked row: uniform in fp32, NaN if the fill became -inf
    mask[1, :, 3] = True
    return x, mask


def rules(gm) -> dict[str, str]:
    return {row["node"]: row["rule"] for row in explain(gm).to_dict()["rows"]}


@pytest.mark.parametrize("level,dtype", CONFIGS, ids=["O1-bf16", "O2-bf16", "O2-fp16", "O1-fp16"])
def test_masked_fill_with_float32_min_runs_fp32_and_gives_the_fp32_result(level, dtype):
    model, (x, mask) = FinfoMaskedAttention(), inputs()
    gm = convert(model, level, dtype=dtype, example_inputs=(x, mask))
    with torch.no_grad():
        out, expected = gm(x, mask), model(x, mask)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, expected, atol=0.05, rtol=0.05)
    assert compare(model, gm, (x, mask)).passed
    amp_compiler.verify(gm, x, mask)
    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    found = rules(gm)
    assert found["masked_fill"].endswith(f"reads the constant -3.40282e+38, beyond {short}'s "
                                         f"{torch.finfo(dtype).max:.5g}: kept fp32")
    precisions = {row["node"]: row["dtype"] for row in explain(gm).to_dict()["rows"]}
    assert precisions["masked_fill"] == precisions["softmax"] == "float32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_o2_keeps_the_softmax_the_fill_reaches_fp32_and_says_why(dtype):
    model, (x, mask) = FinfoMaskedAttention(), inputs()
    found = rules(convert(model, "O2", dtype=dtype, example_inputs=(x, mask)))
    assert "reads masked_fill's value (the constant -3.40282e+38)" in found["softmax"]


@pytest.mark.parametrize("level,dtype", CONFIGS, ids=["O1-bf16", "O2-bf16", "O2-fp16", "O1-fp16"])
def test_an_added_float32_min_mask_keeps_the_add_and_softmax_fp32(level, dtype):
    model, (x, mask) = FinfoAddedMask(), inputs()
    keep = (~mask).float()
    gm = convert(model, level, dtype=dtype, example_inputs=(x, keep))
    found = rules(gm)
    assert "reads the constant -3.40282e+38" in found["mul"]
    assert "kept fp32" in found["add"] and "kept fp32" in found["softmax"] or level == "O1"
    with torch.no_grad():
        assert torch.isfinite(gm(x, keep)).all()
    assert compare(model, gm, (x, keep)).passed
    amp_compiler.verify(gm, x, keep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_tensor_constant_holding_float32_min_keeps_its_reader_fp32(dtype):
    model, (x, _) = FinfoBufferMask(), inputs()
    gm = convert(model, "O2", dtype=dtype, example_inputs=(x,))
    assert "reads the tensor constant bias, which holds -3.40282e+38" in rules(gm)["add"]
    assert compare(model, gm, (x,)).passed


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_integer_division_is_recorded_as_the_float32_it_computes(level):
    model, x = BucketedPositions(), torch.randn(2, 6, 8)
    gm = convert(model, level, dtype=torch.bfloat16, example_inputs=(x,))
    amp_compiler.verify(gm, x)                # the recorded dtypes are the ones that run
    divisions = [row for row in explain(gm).to_dict()["rows"] if row["op"] == "div"]
    assert divisions and all(row["dtype"] == "float32" and "integer operands only" in row["rule"] for row in divisions)


def test_convert_onnx_in_bf16_keeps_the_reader_of_a_float32_min_constant_fp32():
    """The ONNX side's range guard: a Where filling with finfo(float32).min (a Constant) reads it fp32 in
    bf16 too (it was fp16-only: in bf16 the Where ran low and its Cast made the fill -inf)."""
    import numpy as np
    from onnx import TensorProto, helper

    from onnx_testing import initializer, make_model, tensor_input
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"], name="scores"),
             helper.make_node("Constant", [], ["fill"], name="fill",
                              value=helper.make_tensor("fill_value", TensorProto.FLOAT, [], [F32_MIN])),
             helper.make_node("Where", ["mask", "fill", "scores"], ["masked"], name="where_masked"),
             helper.make_node("Softmax", ["masked"], ["y"], axis=-1, name="softmax")]
    model = make_model(nodes, [tensor_input("x", TensorProto.FLOAT, [2, 4]), tensor_input("mask", TensorProto.BOOL, [2, 4])],
                       [tensor_input("y", TensorProto.FLOAT, [2, 4])], [initializer("w", np.eye(4, dtype=np.float32))])
    for level in ("O1", "O2"):
        report = amp_compiler.convert_onnx(model, None, level, dtype=torch.bfloat16)
        decided = {row["node"]: row for row in report.rows}
        assert decided["scores"]["precision"] == "bfloat16", decided["scores"]
        assert decided["where_masked"]["precision"] == "float32"
        assert "3.40282e+38 > 3.3895e+38 (bf16 max): kept fp32" in decided["where_masked"]["rule"]
