"""validate_onnx: per-output errors, the first drifting node, and sessions that stay quiet on CPU."""
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn

from amp_compiler import convert_onnx, export_onnx, validate_onnx
from amp_compiler.onnx import sessions as onnx_sessions
from onnx_testing import F32, initializer, make_model, save, tensor_input


def overflowing_model():
    """relu(x @ w) @ v: with x ~ 300 and w = 100 the first MatMul reaches 120000 > 65504."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="first_matmul"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "v"], ["y"], name="second_matmul")]
    return make_model(nodes, [tensor_input("x", F32, [1, 4])], [tensor_input("y", F32, [1, 2])],
                      [initializer("w", np.full((4, 4), 100.0, np.float32)),
                       initializer("v", np.full((4, 2), 1e-3, np.float32))])


def test_overflow_is_reported_with_the_first_drifting_node(tmp_path):
    src = save(overflowing_model(), tmp_path, "fp32.onnx")
    dst = str(tmp_path / "fp16.onnx")
    convert_onnx(src, dst)
    x = np.full((1, 4), 300.0, np.float32)
    report = validate_onnx(dst, src, (x,), compare_intermediates=True)
    assert not report.passed and report.outputs[0].value == "y"
    assert report.outputs[0].max_abs == float("inf")
    assert report.first_failure.node == "first_matmul" and report.first_failure.op == "MatMul"
    assert "first drifting node: first_matmul (MatMul)" in str(report)
    assert validate_onnx(dst, src, (np.ones((1, 4), np.float32),)).passed     # in range: fine


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.fc1(x))), dim=-1)


@pytest.mark.slow
def test_an_export_validates_against_its_module(tmp_path):
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(3, 8)
    path = str(tmp_path / "two_layer.onnx")
    export_onnx(model, (x,), path)
    report = validate_onnx(path, model, (x,))
    assert report.passed and report.outputs[0].max_abs < 1e-2 and report.outputs[0].shape == (3, 4)
    drift = validate_onnx(path, model, (x,), compare_intermediates=True)
    assert len(drift.errors) > 0 and drift.first_failure is None


def test_bad_files_are_named(tmp_path):
    text = tmp_path / "readme.onnx"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="readme.onnx is not an ONNX model"):
        validate_onnx(str(text), str(text), (np.ones(1),))


def test_cuda_is_requested_only_when_usable(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnx_sessions, "cuda_usable", lambda: False)
    assert onnx_sessions.execution_providers() == ["CPUExecutionProvider"]
    monkeypatch.setattr(onnx_sessions, "cuda_usable", lambda: True)
    assert onnx_sessions.execution_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert onnx_sessions.execution_providers() == ["CPUExecutionProvider"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_sessions_print_nothing_on_a_cpu_machine(tmp_path, capfd):
    path = save(overflowing_model(), tmp_path, "m.onnx")
    session = onnx_sessions.make_session(path)
    session.run(None, {"x": np.ones((1, 4), np.float32)})
    assert session.get_providers() == ["CPUExecutionProvider"]
    out, err = capfd.readouterr()
    assert out == "" and err == ""
