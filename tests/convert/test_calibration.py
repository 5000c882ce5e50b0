"""convert(..., calibration_data=...): fp32 runs on samples; nodes whose values the low dtype cannot hold
stay fp32, with the figure in their rule."""
import re

import pytest
import torch
from torch import nn

from amp_compiler import compare, convert, explain
from amp_compiler.passes.painting import calibrate_ranges


class Planted(nn.Module):
    """An activation scaled by 1e5 between two matmuls (by two constants fp16 holds: no constant warning)."""

    def __init__(self, scale=(400.0, 250.0)):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return self.b(self.a(x) * self.scale[0] * self.scale[1])


def rules(gm) -> dict:
    return {row["node"]: (row["dtype"], row["rule"]) for row in explain(gm).rows}


def samples(n, magnitude=1.0, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(4, 8) * magnitude,) for _ in range(n)]


def test_calibrated_o1_keeps_the_overflowing_nodes_fp32_and_the_output_right():
    torch.manual_seed(0)
    model, x = Planted(), torch.randn(4, 8)
    plain = convert(model, "O1", example_inputs=(x,))
    assert not compare(model, plain, x).passed and not torch.isfinite(plain(x)).all()
    gm = convert(model, "O1", example_inputs=(x,), calibration_data=samples(16))
    decided = rules(gm)
    assert decided["mul"][0] == "float16"                    # 400x: fp16 holds it
    assert decided["mul_1"][0] == "float32" and re.fullmatch(
        r"range: max \|x\| = \d(\.\d)?e5 > 65504 on 16 of 16 samples", decided["mul_1"][1])
    assert decided["b"][0] == "float32" and decided["b"][1].startswith("range: ")
    assert decided["linear"][0] == "float16"
    report = compare(model, gm, x)
    assert report.passed and report.outputs[0].max_rel < 1e-3
    assert gm.meta["amp"]["pass_counts"]["calibrate_ranges"] == {"samples": 16, "nodes_overflowing": 2}
    decide, plain_decide = gm.meta["amp"]["pass_counts"]["decide_precision"], plain.meta["amp"]["pass_counts"]["decide_precision"]
    assert (decide["low"], decide["fp32"]) == (plain_decide["low"] - 2, plain_decide["fp32"] + 2)   # counted after calibration
    assert "range calibration (16 samples): 2 nodes kept fp32: mul_1, b" in explain(gm, op="linear").summary_lines()
    assert not any("range calibration" in line for line in explain(plain).summary_lines())


def test_the_rule_counts_the_samples_that_overflow():
    model = Planted()
    data = samples(13, magnitude=0.01) + samples(3, magnitude=1.0, seed=2)   # only the last 3 reach 65504
    gm = convert(model, "O1", example_inputs=data[0], calibration_data=data)
    assert re.search(r"> 65504 on 3 of 16 samples$", rules(gm)["mul_1"][1])
    quiet = convert(model, "O1", example_inputs=data[0], calibration_data=data[:13])
    assert rules(quiet) == rules(convert(model, "O1", example_inputs=data[0]))   # nothing to keep: unchanged


def test_values_mostly_below_fp16s_normal_range_stay_fp32_but_bf16_holds_them():
    model = Planted(scale=(1e-3, 1e-3))
    data = samples(4)
    gm = convert(model, "O1", example_inputs=data[0], calibration_data=data)
    dtype, rule = rules(gm)["mul_1"]
    assert dtype == "float32" and re.fullmatch(
        r"range: 100% of its non-zero values are below float16's normal range \(6\.1e-5\) over 4 samples", rule)
    assert rules(gm)["mul"][0] == "float16"                  # 1e-3 x: still normal
    bf16 = convert(model, "O1", dtype=torch.bfloat16, example_inputs=data[0], calibration_data=data)
    assert not any(rule.startswith("range:") for _, rule in rules(bf16).values())


def test_calibration_runs_in_eval_mode_and_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = convert(model, "O1", calibration_data=samples(3, magnitude=3.0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # running stats untouched
    assert gm.meta["amp"]["pass_counts"]["calibrate_ranges"]["samples"] == 3
    assert model.training and all(m.training for m in model.modules())


def test_calibration_data_may_be_a_generator_and_must_not_be_empty():
    model = Planted()
    gm = convert(model, "O1", example_inputs=samples(1)[0], calibration_data=(s for s in samples(16)))
    assert rules(gm)["mul_1"][0] == "float32"
    with pytest.raises(ValueError, match="calibration_data gave no samples"):
        convert(model, "O1", example_inputs=samples(1)[0], calibration_data=[])


def test_many_samples_get_a_progress_bar(monkeypatch):
    shown = []
    real = calibrate_ranges.tqdm
    monkeypatch.setattr(calibrate_ranges, "tqdm", lambda items, **kw: shown.append(kw["disable"]) or real(items, **kw))
    convert(Planted(), "O1", example_inputs=samples(1)[0], calibration_data=samples(3))
    convert(Planted(), "O1", example_inputs=samples(1)[0], calibration_data=samples(calibrate_ranges.PROGRESS_FROM))
    assert shown == [True, None]          # few: none; many: tqdm's own choice (on a terminal)


def test_convert_onnx_with_calibration_data_keeps_the_overflowing_nodes_fp32(tmp_path):
    import numpy as np
    from amp_compiler import convert_onnx, validate_onnx
    from onnx_testing import save
    from test_onnx_validate import overflowing_model           # x @ 100: 120000 for x = 300
    src = save(overflowing_model(), tmp_path, "fp32.onnx")
    x = np.full((1, 4), 300.0, np.float32)
    plain = convert_onnx(src, str(tmp_path / "plain.onnx"))
    # ONNX Runtime's CPU kernels keep a fused fp16 chain in fp32: the intermediates show the fp16 values
    assert not validate_onnx(tmp_path / "plain.onnx", src, (x,), compare_intermediates=True).passed
    data = [(x * scale,) for scale in (0.1, 0.5, 1.0, 1.2)]     # the last two pass 65504
    report = convert_onnx(src, str(tmp_path / "calibrated.onnx"), calibration_data=data)
    rules = {row["node"]: (row["precision"], row["rule"]) for row in report.rows}
    assert rules["first_matmul"] == ("float32", "range: max |x| = 1.4e5 > 65504 on 2 of 4 samples")
    assert rules["relu"] == ("float32", "range: max |x| = 1.4e5 > 65504 on 2 of 4 samples")
    assert rules["second_matmul"] == ("float32", "range: reads relu: max |x| = 1.4e5 > 65504 on 2 of 4 samples")
    assert report.pass_counts["calibrate_ranges"] == {"samples": 4, "nodes_overflowing": 3}
    assert validate_onnx(tmp_path / "calibrated.onnx", src, (x,), compare_intermediates=True).passed
    assert plain.pass_counts.keys() == report.pass_counts.keys() - {"calibrate_ranges"}
