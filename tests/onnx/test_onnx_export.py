"""export_onnx specifics: weights beyond fp16, dynamic shapes, low-precision I/O, torch's mixed-dtype norms;
the export passes that make it an inference model (widen_denied_ops, store_moved_weights_low,
lower_movers_between_casts, store_tied_weights_once). Real models: test_onnx_export_inference.py."""
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnx import helper
from torch import nn

from amp_compiler import export_onnx
from amp_compiler.passes.onnx.lower_movers_between_casts import lower_onnx_movers_between_casts
from amp_compiler.passes.onnx.store_tied_weights_once import store_onnx_tied_weights_once
from onnx_testing import F16, F32, I64, all_nodes, assert_valid, initializer, input_types, make_model, nodes_of, \
    run, tensor_input, value_types


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_dynamic_batch(tmp_path, net):
    path = str(tmp_path / "dynamic.onnx")
    export_onnx(net, (torch.randn(2, 8),), path, dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert_valid(path)
    x = torch.randn(5, 8)
    (out,) = run(path, {"x": x.numpy()})
    assert out.shape == (5, 4) and np.allclose(out, net(x).detach().numpy(), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_keep_io_types_false_takes_and_returns_fp16(tmp_path, net):
    path = str(tmp_path / "io16.onnx")
    export_onnx(net, (torch.randn(2, 8),), path, keep_io_types=False)
    assert_valid(path)
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.elem_type == F16
    assert model.graph.output[0].type.tensor_type.elem_type == F16


@pytest.mark.slow
def test_o3_norm_weights_follow_the_fp16_data(tmp_path, net):
    """torch runs layer_norm on fp16 data with fp32 weights; ONNX needs one type: the weights become fp16."""
    path = str(tmp_path / "o3.onnx")
    report = export_onnx(net, (torch.randn(2, 8),), path, "O3")
    assert_valid(path)
    model = onnx.load(path)
    norm = next(n for n in all_nodes(model) if n.op_type == "LayerNormalization")
    assert input_types(model, norm) == [F16, F16, F16]
    assert report.pass_counts["unify_input_types"]["mixed_dtype_inputs_cast"] == 2


@pytest.mark.slow
def test_o1_norm_stays_fp32(tmp_path, net):
    path = str(tmp_path / "o1.onnx")
    export_onnx(net, torch.randn(2, 8), path)       # a single tensor is accepted for args
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


# ----------------------------------------------------------------------- the passes of an inference export
class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.attn, self.out = nn.Linear(8, 24), Attention(), nn.Linear(8, 4)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))   # 2 heads
        return self.out(self.attn(q, k, v).transpose(1, 2).flatten(-2))


@pytest.mark.slow
def test_the_softmax_of_a_decomposed_attention_runs_fp32_unless_forced_low(tmp_path):
    torch.manual_seed(0)
    model, x = AttentionNet().eval(), torch.randn(2, 5, 8)
    for forced, dtype in (((), F32), (("attn",), F16)):
        path = str(tmp_path / f"attention_{len(forced)}.onnx")
        report = export_onnx(model, (x,), path, force_low=list(forced))
        assert_valid(path)
        onnx_model = onnx.load(path)
        (softmax,) = nodes_of(onnx_model, "Softmax")
        assert value_types(onnx_model)[softmax.input[0]] == dtype
        assert report.pass_counts["widen_denied_ops"]["denied_nodes_widened"] == (dtype == F32)
        (out,) = run(path, {"x": x.numpy()})
        assert np.allclose(out, model(x).detach().numpy(), rtol=1e-2, atol=1e-2)


class EmbeddingNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


@pytest.mark.slow
@pytest.mark.parametrize("peak, stored", [(1.0, F16), (1.0e5, F32)])
def test_an_embedding_table_is_stored_fp16_unless_fp16_cannot_hold_it(tmp_path, peak, stored):
    torch.manual_seed(0)
    model, tokens = EmbeddingNorm().eval(), torch.tensor([[1, 2, 3], [3, 2, 1]])
    with torch.no_grad():
        model.embed.weight[5, 0] = peak     # a row the tokens do not read: only the storage is at stake
    path = str(tmp_path / "embedding.onnx")
    report = export_onnx(model, (tokens,), path)
    assert_valid(path)
    onnx_model = onnx.load(path)
    (lookup,) = nodes_of(onnx_model, "Gather")
    table = next(t for t in onnx_model.graph.initializer if t.name == lookup.input[0])
    assert table.data_type == stored
    assert report.pass_counts["store_moved_weights_low"]["moved_weights_stored_low"] == (stored == F16)
    (out,) = run(path, {"tokens": tokens.numpy()})
    assert np.allclose(out, model(tokens).detach().numpy(), rtol=1e-2, atol=1e-2)


def _movers_model(extra_fp32_reader: bool) -> ir.Model:
    """x_f16 -> Cast(FLOAT) -> Transpose -> Reshape -> Cast(FLOAT16) -> y (and maybe an fp32 Relu of the Transpose)."""
    nodes = [helper.make_node("Cast", ["x"], ["up"], to=F32, name="up"),
             helper.make_node("Transpose", ["up"], ["t"], perm=[1, 0], name="transpose"),
             helper.make_node("Reshape", ["t", "shape"], ["r"], name="reshape"),
             helper.make_node("Cast", ["r"], ["y"], to=F16, name="down")]
    outputs = [helper.make_tensor_value_info("y", F16, [6])]
    if extra_fp32_reader:
        nodes.append(helper.make_node("Relu", ["t"], ["z"], name="relu"))
        outputs.append(helper.make_tensor_value_info("z", F32, [3, 2]))
    proto = make_model(nodes, [tensor_input("x", F16, [2, 3])], outputs,
                       [initializer("shape", np.array([6], np.int64))])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def test_movers_between_a_cast_up_and_casts_down_read_the_low_value(tmp_path):
    model = _movers_model(extra_fp32_reader=False)
    result = lower_onnx_movers_between_casts(model)
    assert result.counts == {"movers_lowered": 2, "casts_removed": 2}
    proto = ir.serde.serialize_model(model)
    assert [n.op_type for n in proto.graph.node] == ["Transpose", "Reshape"]
    path = str(tmp_path / "movers.onnx")
    onnx.save(proto, path)
    assert_valid(path)
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    (y,) = run(path, {"x": x})
    assert y.dtype == np.float16 and np.array_equal(y, x.T.reshape(6))


def test_a_mover_with_an_fp32_reader_keeps_its_casts():
    model = _movers_model(extra_fp32_reader=True)
    assert not lower_onnx_movers_between_casts(model).modified
    assert sum(n.op_type == "Cast" for n in model.graph) == 2


def test_a_transposed_copy_of_a_weight_is_stored_once(tmp_path):
    """Gather(table) and MatMul(h, table.T): what a tied LM head exports to; and a copy with the same bytes."""
    table = np.arange(12, dtype=np.float16).reshape(6, 2) / 8
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
             helper.make_node("Gather", ["same_as_table", "ids"], ["rows_again"], name="lookup_again"),
             helper.make_node("Add", ["rows", "rows_again"], ["both"], name="add"),
             helper.make_node("MatMul", ["both", "head"], ["logits"], name="head_matmul")]
    proto = make_model(nodes, [tensor_input("ids", I64, [3])], [helper.make_tensor_value_info("logits", F16, [3, 6])],
                       [initializer("table", table), initializer("head", np.ascontiguousarray(table.T)),
                        initializer("same_as_table", table.copy())])
    before = str(tmp_path / "before.onnx")
    onnx.save(proto, before)
    model = ir.from_proto(proto)
    result = store_onnx_tied_weights_once(model)
    assert result.counts == {"tied_weight_copies_removed": 2, "tied_weight_bytes_saved": 2 * table.nbytes}
    after = str(tmp_path / "after.onnx")
    onnx.save(ir.serde.serialize_model(model), after)
    assert_valid(after)
    stored = onnx.load(after)
    assert [t.name for t in stored.graph.initializer] == ["table"]
    assert stored.graph.node[0].op_type == "Transpose" and stored.graph.node[0].input == ["table"]
    ids = np.array([0, 3, 5], np.int64)
    assert np.array_equal(run(after, {"ids": ids})[0], run(before, {"ids": ids})[0])
