"""export_onnx specifics: weights beyond fp16, dynamic shapes, low-precision I/O, torch's mixed-dtype norms."""
import numpy as np
import onnx
import pytest
import torch
from torch import nn

from amp_compiler import export_onnx
from onnx_testing import F16, F32, all_nodes, assert_valid, input_types, run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().eval()


def test_a_weight_beyond_fp16_is_exported_fp32_and_reported(tmp_path, net):
    with torch.no_grad():
        net.fc2.weight[0, 0] = 1.0e5
    x = torch.randn(2, 8)
    path = str(tmp_path / "big.onnx")
    report = export_onnx(net, (x,), path)
    assert_valid(path)
    assert any("fc2.weight holds |x| up to 100000" in w and "'fc2'" in w for w in report.warnings)
    assert {r["node"]: r["precision"] for r in report.rows}["fc2"] == "float32"
    (out,) = run(path, {"x": x.numpy()})
    assert np.isfinite(out).all() and np.allclose(out, net(x).detach().numpy(), rtol=1e-2, atol=1e-2)


def test_dynamic_batch(tmp_path, net):
    path = str(tmp_path / "dynamic.onnx")
    export_onnx(net, (torch.randn(2, 8),), path, dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert_valid(path)
    x = torch.randn(5, 8)
    (out,) = run(path, {"x": x.numpy()})
    assert out.shape == (5, 4) and np.allclose(out, net(x).detach().numpy(), rtol=1e-2, atol=1e-2)


def test_keep_io_types_false_takes_and_returns_fp16(tmp_path, net):
    path = str(tmp_path / "io16.onnx")
    export_onnx(net, (torch.randn(2, 8),), path, keep_io_types=False)
    assert_valid(path)
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.elem_type == F16
    assert model.graph.output[0].type.tensor_type.elem_type == F16


def test_o3_norm_weights_follow_the_fp16_data(tmp_path, net):
    """torch runs layer_norm on fp16 data with fp32 weights; ONNX needs one type: the weights become fp16."""
    path = str(tmp_path / "o3.onnx")
    report = export_onnx(net, (torch.randn(2, 8),), path, "O3")
    assert_valid(path)
    model = onnx.load(path)
    norm = next(n for n in all_nodes(model) if n.op_type == "LayerNormalization")
    assert input_types(model, norm) == [F16, F16, F16]
    assert report.pass_counts["unify_input_types"]["mixed_dtype_inputs_cast"] == 2


def test_o1_norm_reads_the_fp16_data_with_fp32_statistics(tmp_path, net):
    """O1 runs norms as mixed kernels in torch (tests/test_mixed_norms.py). ONNX ties LayerNormalization's
    scale to its data's type, so the scale follows the fp16 data; the statistics stay fp32 (stash_type)."""
    path = str(tmp_path / "o1.onnx")
    export_onnx(net, torch.randn(2, 8), path)       # a single tensor is accepted for args
    assert_valid(path)
    model = onnx.load(path)
    norm = next(n for n in all_nodes(model) if n.op_type == "LayerNormalization")
    assert input_types(model, norm)[0] == F16
    assert next((a.i for a in norm.attribute if a.name == "stash_type"), onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT
    export_onnx(net, torch.randn(2, 8), path, keep_batchnorm_fp32=False)   # the norm in fp32 between casts
    model = onnx.load(path)
    norm = next(n for n in all_nodes(model) if n.op_type == "LayerNormalization")
    assert input_types(model, norm)[0] == F32


def test_bad_arguments_are_named(tmp_path, net):
    with pytest.raises(ValueError, match="'O9'"):
        export_onnx(net, (torch.randn(2, 8),), str(tmp_path / "x.onnx"), "O9")
    with pytest.raises(ValueError, match="float64"):
        export_onnx(net, (torch.randn(2, 8),), str(tmp_path / "x.onnx"), dtype=torch.float64)
    with pytest.raises(TypeError, match="nn.Module"):
        export_onnx(lambda x: x, (torch.randn(2, 8),), str(tmp_path / "x.onnx"))
