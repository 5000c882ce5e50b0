"""compare(): per-node error against fp32, the first node past tolerance, the chain that leads to it."""
import json
import math

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import ComparisonReport, compare, convert
from models import build


class MaskedAttention(nn.Module):
    """A hand-written mask: masked_fill(-1e9), beyond fp16's range, then softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)).masked_fill(mask, -1e9)
        return torch.softmax(scores, -1) @ x


class Planted(nn.Module):
    """An activation scaled by 1e5 between two matmuls: fine in fp32, past 65504 in fp16."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x) * 1e5)


@pytest.fixture(scope="module")
def gpt():
    task = build("gpt", size="small", seed=0)
    return task.model, convert(task.model, "O1", example_inputs=task.example_inputs), task.example_inputs


@pytest.mark.slow
def test_a_sound_conversion_passes_with_every_float_node_measured(gpt):
    model, gm, inputs = gpt
    report = compare(model, gm, inputs)
    assert report.passed and report.first_failure is None and report.chain == [] and report.notes == []
    float_nodes = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr", "placeholder")
                   and n.meta["amp"].get("dtype") is not None and n.meta["amp"]["dtype"].is_floating_point]
    assert {e.node for e in report.errors} >= {n.name for n in float_nodes if n.meta["amp"].get("precision") == "low"}
    ranks = [e.max_rel for e in report.errors]
    assert ranks == sorted(ranks, reverse=True) and 0 < ranks[0] < 1e-2
    assert all(e.ulps < 8 for e in report.errors)              # a few fp16 steps, nowhere more
    assert "no node past tolerance" in str(report)
    assert model.training and gm.training                      # compared in eval mode, modes restored


@pytest.mark.slow
def test_the_first_node_past_tolerance_comes_with_its_chain(gpt):
    model, gm, inputs = gpt
    report = compare(model, gm, inputs, rtol=1e-5)
    failing = [e.node for e in report.errors if not e.ok]
    order = [n.name for n in gm.graph.nodes]
    assert report.first_failure.node == min(failing, key=order.index)
    assert report.chain[-1] == report.first_failure
    chain_nodes = [order.index(e.node) for e in report.chain]
    assert chain_nodes == sorted(chain_nodes)                  # from an input forward to the failure


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_the_fp16_cast_of_a_minus_1e9_mask_is_found(level):
    torch.manual_seed(0)
    model, x = MaskedAttention(), torch.randn(2, 4, 8)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = True                                          # a fully masked row: -inf everywhere -> NaN
    # the softmax would stay fp32 (the constant's path does): forced low, it reads the -inf
    gm = convert(model, level, example_inputs=(x, mask), force_low=["softmax"])
    report = compare(model, gm, (x, mask))
    assert not report.passed
    culprit = report.first_failure
    assert culprit.op == "cast" and culprit.dtype == "float16" and culprit.non_finite > 0
    assert [e.node for e in report.chain][-2:] == ["masked_fill", culprit.node]
    assert report.errors[0].non_finite > 0                     # the worst-first list starts with non-finite
    assert f"first node past tolerance: {culprit.node} (cast)" in str(report)
    assert compare(model, convert(model, "O1", example_inputs=(x, mask)), (x, mask)).passed


def test_a_planted_overflow_between_two_matmuls_is_found():
    torch.manual_seed(0)
    model, x = Planted(), torch.randn(4, 8)
    report = compare(model, convert(model, "O1", force_low=["b"]), x)   # b would stay fp32: forced low
    assert not report.passed and math.isinf(report.outputs[0].max_abs)
    assert report.first_failure.node == "mul_float16" and report.first_failure.non_finite > 0
    assert compare(model, convert(model, "O1", dtype=torch.bfloat16), x).passed     # bf16 has the range


@pytest.mark.slow
def test_the_report_is_data_too(gpt):
    model, gm, inputs = gpt
    data = compare(model, gm, inputs).to_dict()
    assert data["passed"] is True and data["low_dtype"] == "float16" and data["rtol"] == 1e-2
    assert json.loads(json.dumps(data))["errors"][0].keys() >= {"node", "op", "max_abs", "max_rel", "ulps", "ok"}


def test_only_converted_graphs_are_compared():
    with pytest.raises(ValueError, match="GraphModule convert"):
        compare(nn.Linear(2, 2), nn.Linear(2, 2), torch.randn(1, 2))
    assert amp_compiler.compare is compare and "compare" in amp_compiler.__all__


@pytest.mark.slow
def test_validate_onnx_returns_the_same_report_type(tmp_path):
    from amp_compiler import export_onnx, validate_onnx
    torch.manual_seed(0)
    model, x = Planted(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match="reaches b"):        # the conversion warns about the 1e5 too
        export_onnx(model, (x,), tmp_path / "planted.onnx", force_low=["b"])
    onnx_report = validate_onnx(tmp_path / "planted.onnx", model, (x,), compare_intermediates=True)
    fx_report = compare(model, convert(model, "O1", force_low=["b"]), x)
    assert type(onnx_report) is type(fx_report) is ComparisonReport   # one report class, one set of names
    assert onnx_report.to_dict().keys() == fx_report.to_dict().keys()
    failure = onnx_report.first_failure
    assert not onnx_report.passed and failure.op == "Gemm" and failure.dtype == "float16" and failure.non_finite > 0
    assert onnx_report.chain[-1] is failure and onnx_report.errors[0].non_finite > 0
    assert onnx_report.outputs[0].max_abs == math.inf
    assert onnx_report.source == str(tmp_path / "planted.onnx") and onnx_report.providers
    assert f"first drifting node: {failure.node} (Gemm)" in str(onnx_report)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_a_low_leaf_with_parameters_replays_in_fp32():
    """An LSTM runs through amp_module_call (its weights cast per call): the fp32 replay runs it as written."""
    from amp_compiler.passes.fx.runtime import amp_module_call
    torch.manual_seed(0)
    model, x = Tagger(), torch.randn(2, 5, 8)
    gm = convert(model, "O1", example_inputs=(x,))
    assert any(node.target is amp_module_call for node in gm.graph.nodes)
    report = compare(model, gm, x)                 # was: "RNN input dtype (float32) does not match weight dtype"
    assert report.passed and report.notes == [] and 0 < report.outputs[0].max_rel < 1e-2


def test_a_long_chain_prints_its_ends():
    from amp_compiler.insight.compare import NodeError
    chain = [NodeError(f"n{i}", "conv2d", "", "float16", (2,), 0.1, 0.02, 3.0, 0, i < 19) for i in range(20)]
    text = str(ComparisonReport("float16", 1e-2, list(chain), [chain[-1]], chain[-1], chain))
    assert "  chain: n0 -> n1 -> ... (13 more) -> n15 -> n16 -> n17 -> n18 -> n19" in text
    lines = text.splitlines()
    shown = lines[lines.index(next(l for l in lines if l.startswith("  chain:"))) + 1:lines.index("  worst nodes:")]
    assert [line.split()[0] for line in shown] == ["n0", "n1", "...", "n15", "n16", "n17", "n18", "n19"]
