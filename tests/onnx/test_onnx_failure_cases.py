"""convert_onnx on hand-written graphs, one per way the existing fp16 converters fail
(../shared/reference/onnx-fp16-converters.md): each output passes onnx.checker (full_check), loads and
runs in ONNX Runtime, has clean casts, is sorted, and converting it again changes nothing."""
import numpy as np
import onnx
import pytest
from onnx import helper

from amp_compiler import convert_onnx
from onnx_testing import (BOOL, F16, F32, I64, assert_valid, initializer, input_types, make_model, nodes_of, run,
                          same_model, save, tensor_input, value_types)

RNG = np.random.default_rng(0)


def weights(*shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def convert_checked(tmp_path, model, level="O1", **options):
    """Convert, validate, convert again: returns (converted proto, its path, report)."""
    src = save(model, tmp_path, "src.onnx")
    dst, again = str(tmp_path / f"fp16_{level}.onnx"), str(tmp_path / f"fp16_{level}_again.onnx")
    report = convert_onnx(src, dst, level, **options)
    assert_valid(dst)
    convert_onnx(dst, again, level, **options)
    assert same_model(dst, again), "converting a converted model must change nothing"
    return onnx.load(dst), dst, report


def reference_outputs(tmp_path, model, feeds):
    return run(save(model, tmp_path, "reference.onnx"), feeds)


# 1. Resize: scales (tensor(float) only) and roi keep fp32 at every level (oc #207 #208 #306, ORT #8327).
def resize_model():
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Resize", ["c1", "roi", "scales"], ["up"], mode="linear", name="resize"),
             helper.make_node("Conv", ["up", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2")]
    inits = [initializer("w1", weights(4, 3, 3, 3)), initializer("w2", weights(2, 4, 3, 3)),
             initializer("roi", np.zeros(0, np.float32)), initializer("scales", np.array([1, 1, 2, 2], np.float32))]
    return make_model(nodes, [tensor_input("x", F32, [1, 3, 8, 8])], [tensor_input("y", F32, None)], inits)


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_resize_scales_and_roi_stay_fp32(tmp_path, level):
    model = resize_model()
    converted, path, _ = convert_checked(tmp_path, model, level)
    types = value_types(converted)
    assert types["scales"] == F32 and types["roi"] == F32
    resize = nodes_of(converted, "Resize")[0]
    assert input_types(converted, resize)[0] == (F32 if level == "O1" else F16)   # interpolate: deny at O1
    assert all(input_types(converted, c)[:2] == [F16, F16] for c in nodes_of(converted, "Conv"))
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    (out,), (ref,) = run(path, {"x": x}), reference_outputs(tmp_path, model, {"x": x})
    assert out.dtype == np.float32 and np.allclose(out, ref, rtol=1e-2, atol=1e-2)


# 2. If: both branches converted in place; outer values read inside; branch outputs agree with the If.
def if_model():
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w2"], ["t_mm"], name="then_matmul"),
         helper.make_node("Relu", ["t_mm"], ["t_out"], name="then_relu")],
        "then", [], [tensor_input("t_out", F32, [2, 4])])
    else_branch = helper.make_graph(
        [helper.make_node("Softmax", ["h"], ["e_out"], axis=-1, name="else_softmax")],
        "else", [], [tensor_input("e_out", F32, [2, 4])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="matmul"),
             helper.make_node("If", ["cond"], ["branch"], then_branch=then_branch, else_branch=else_branch,
                              name="if"),
             helper.make_node("MatMul", ["branch", "w3"], ["y"], name="head")]
    inits = [initializer("w1", weights(4, 4)), initializer("w2", weights(4, 4)), initializer("w3", weights(4, 3))]
    return make_model(nodes, [tensor_input("x", F32, [2, 4]), tensor_input("cond", BOOL, [])],
                      [tensor_input("y", F32, [2, 3])], inits)


def test_if_branches_are_converted_in_place(tmp_path):
    model = if_model()
    converted, path, report = convert_checked(tmp_path, model)
    decided = {r["node"]: r["precision"] for r in report.rows}
    assert decided["then_matmul"] == "float16" and decided["else_softmax"] == "float32"
    assert decided["matmul"] == decided["head"] == "float16"
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        (out,), (ref,) = run(path, feeds), reference_outputs(tmp_path, model, feeds)
        assert out.dtype == np.float32 and np.allclose(out, ref, rtol=1e-2, atol=1e-2)


# 3. Casts already in the graph are retargeted or removed, never left stale (oc #320 #331, ORT #25522).
def existing_casts_model():
    nodes = [helper.make_node("Cast", ["ids"], ["ids_f"], to=F32, name="ids_to_float"),      # int -> fp32
             helper.make_node("MatMul", ["ids_f", "w"], ["h"], name="matmul"),
             helper.make_node("Cast", ["h"], ["h_same"], to=F32, name="noop_cast"),            # fp32 -> fp32
             helper.make_node("Cast", ["h_same"], ["h_half"], to=F16, name="user_half"),       # fp32 -> fp16
             helper.make_node("Cast", ["h_half"], ["h_back"], to=F32, name="user_float"),      # and back
             helper.make_node("Softmax", ["h_back"], ["y"], axis=-1, name="softmax")]
    model = make_model(nodes, [tensor_input("ids", I64, [2, 4])], [tensor_input("y", F32, [2, 4])],
                       [initializer("w", weights(4, 4))])
    return onnx.shape_inference.infer_shapes(model)   # value_info for every value, as oc's inputs have


def test_existing_casts_are_retargeted_or_removed(tmp_path):
    converted, path, report = convert_checked(tmp_path, existing_casts_model())
    casts = nodes_of(converted, "Cast")
    assert [c.name for c in casts if c.input[0] == "ids"] == ["ids_to_float"]
    assert next(a.i for a in casts[0].attribute if a.name == "to") == F16      # retargeted, no Cast chain
    assert report.pass_counts["strip_float_casts"]["source_float_casts_removed"] == 3
    ids = np.array([[1, 2, 3, 4], [0, 1, 0, 1]], np.int64)
    (out,) = run(path, {"ids": ids})
    assert out.dtype == np.float32 and np.allclose(out.sum(-1), 1.0, atol=1e-3)


# 4. Random ops and other dtype-attribute sources follow the conversion (ORT #20570 #16449).
def random_ops_model():
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"], name="matmul_0"),
             helper.make_node("RandomNormalLike", ["h0"], ["noise"], dtype=F32, scale=0.01, name="noise"),
             helper.make_node("Add", ["h0", "noise"], ["noisy"], name="add_noise"),
             helper.make_node("MatMul", ["noisy", "w"], ["h"], name="matmul"),
             helper.make_node("RandomUniform", [], ["u"], dtype=F32, shape=[2, 4], name="uniform"),
             helper.make_node("EyeLike", ["square"], ["eye"], dtype=F32, name="eye"),
             helper.make_node("ConstantOfShape", ["shape"], ["ones"],
                              value=helper.make_tensor("v", F32, [1], [1.0]), name="ones"),
             helper.make_node("MatMul", ["u", "eye"], ["ue"], name="matmul_u"),
             helper.make_node("MatMul", ["ue", "ones"], ["uo"], name="matmul_ones"),
             helper.make_node("Add", ["uo", "h"], ["y"], name="sum")]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])],
                      [initializer("w", weights(4, 4)), initializer("w0", weights(4, 4)),
                       initializer("shape", np.array([4, 4], np.int64)),
                       initializer("square", np.zeros((4, 4), np.float32))])


def test_random_op_dtype_attributes_follow_the_conversion(tmp_path):
    converted, path, _ = convert_checked(tmp_path, random_ops_model())
    dtype_of = {n.name: next((a.i for a in n.attribute if a.name == "dtype"), None) for n in converted.graph.node}
    types = value_types(converted)
    assert dtype_of["noise"] == F16 and types["noise"] == F16           # painted low: the attribute follows
    # ONNX Runtime has no fp16 RandomUniform / fp32->fp16 EyeLike kernel: they stay fp32, cast once each
    assert dtype_of["uniform"] == dtype_of["eye"] == F32
    cast_sources = [c.input[0] for c in nodes_of(converted, "Cast")]
    assert cast_sources.count("u") == cast_sources.count("eye") == 1
    fill = next(a.t for n in converted.graph.node if n.name == "ones" for a in n.attribute if a.name == "value")
    assert fill.data_type == F16
    (out,) = run(path, {"x": RNG.standard_normal((2, 4)).astype(np.float32)})
    assert out.dtype == np.float32 and np.isfinite(out).all()


# 5. An initializer read by fp32 and fp16 consumers: each reads its own copy, both correct.
def shared_initializer_model():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="gemm"),
             helper.make_node("Add", ["x", "b"], ["xb"], name="add_bias"),
             helper.make_node("LayerNormalization", ["xb", "gamma", "b"], ["n"], name="norm"),
             helper.make_node("Add", ["h", "n"], ["y"], name="sum")]
    inits = [initializer("w", weights(4, 4)), initializer("b", weights(4)),
             initializer("gamma", np.ones(4, np.float32))]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])], inits)


def test_shared_initializer_gets_one_copy_per_dtype(tmp_path):
    model = shared_initializer_model()
    converted, path, _ = convert_checked(tmp_path, model)
    stored = {t.name: t.data_type for t in converted.graph.initializer}
    assert stored["b"] == F32 and stored["b_float16"] == F16 and stored["w"] == F16
    gemm = nodes_of(converted, "Gemm")[0]
    add_bias = next(n for n in converted.graph.node if n.name == "add_bias")   # fp32 at O1
    assert gemm.input[2] == "b_float16" and add_bias.input[1] == "b"
    assert np.array_equal(onnx.numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == "b")),
                          onnx.numpy_helper.to_array(model.graph.initializer[1]))
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    (out,), (ref,) = run(path, {"x": x}), reference_outputs(tmp_path, model, {"x": x})
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)


# 6. Values beyond 65504: never clipped; the nodes that read them (through reshapes too) stay fp32.
def big_initializer_model():
    big = weights(4, 4)
    big[0, 0] = 1.0e5
    nodes = [helper.make_node("Reshape", ["w_flat", "shape"], ["w"], name="reshape_w"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul_big"),
             helper.make_node("MatMul", ["h", "w_small"], ["y"], name="matmul_small")]
    inits = [initializer("w_flat", big.reshape(-1)), initializer("shape", np.array([4, 4], np.int64)),
             initializer("w_small", weights(4, 4, scale=1e-3))]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])], inits)


def test_initializer_above_fp16_range_stays_fp32_and_exact(tmp_path):
    model = big_initializer_model()
    converted, path, report = convert_checked(tmp_path, model)
    decided = {r["node"]: r for r in report.rows}
    assert decided["matmul_big"]["precision"] == "float32" and "65504" in decided["matmul_big"]["rule"]
    assert decided["reshape_w"]["precision"] == "float32"
    stored = {t.name: t for t in converted.graph.initializer}
    assert stored["w_flat"].data_type == F32 and onnx.numpy_helper.to_array(stored["w_flat"]).max() == 1.0e5
    x = np.ones((2, 4), np.float32)
    (out,), (ref,) = run(path, {"x": x}), reference_outputs(tmp_path, model, {"x": x})
    assert np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2)


# 7. Loop bodies are converted inside; loop-carried values keep their dtype across iterations.
def loop_model():
    body = helper.make_graph(
        [helper.make_node("MatMul", ["state_in", "w"], ["mm"], name="body_matmul"),
         helper.make_node("Tanh", ["mm"], ["state_out"], name="body_tanh"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [tensor_input("i", I64, []), tensor_input("cond_in", BOOL, []), tensor_input("state_in", F32, [2, 4])],
        [tensor_input("cond_out", BOOL, []), tensor_input("state_out", F32, [2, 4])])
    nodes = [helper.make_node("Loop", ["trips", "", "x"], ["final"], body=body, name="loop"),
             helper.make_node("Softmax", ["final"], ["y"], axis=-1, name="softmax")]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])],
                      [initializer("w", weights(4, 4)), initializer("trips", np.array(3, np.int64))])


def test_loop_body_is_converted_in_place(tmp_path):
    model = loop_model()
    converted, path, report = convert_checked(tmp_path, model)
    assert {r["node"]: r["precision"] for r in report.rows}["body_matmul"] == "float16"
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    (out,), (ref,) = run(path, {"x": x}), reference_outputs(tmp_path, model, {"x": x})
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)


# 8. Models over 2 GB go through external data (tested with a small threshold).
def test_large_models_are_written_with_external_data(tmp_path, monkeypatch):
    from amp_compiler.onnx import files as onnx_files
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD_BYTES", 10)
    monkeypatch.setattr(onnx_files, "EXTERNAL_TENSOR_MIN_BYTES", 16)
    src = save(shared_initializer_model(), tmp_path, "src.onnx")
    dst = str(tmp_path / "big_fp16.onnx")
    convert_onnx(src, dst)
    assert (tmp_path / "big_fp16.onnx.data").exists()
    assert_valid(dst)
    again = str(tmp_path / "again.onnx")   # a source with external data keeps it, next to the new file
    convert_onnx(dst, again)
    assert (tmp_path / "again.onnx.data").exists()
    assert run(again, {"x": np.ones((2, 4), np.float32)})[0].shape == (2, 4)


def test_duplicate_and_missing_node_names_are_made_unique(tmp_path):
    model = shared_initializer_model()
    for node in model.graph.node:
        node.name = "same" if node.op_type == "Add" else ""
    converted, _, _ = convert_checked(tmp_path, model)
    names = [n.name for n in converted.graph.node]
    assert len(names) == len(set(names)) and all(names)


def test_block_lists_keep_nodes_fp32(tmp_path):
    converted, _, report = convert_checked(tmp_path, if_model(), op_block_list=["MatMul"])
    assert all(r["precision"] == "float32" for r in report.rows if r["op_type"] == "MatMul")
    assert "op_block_list: MatMul" in {r["rule"] for r in report.rows}
    _, _, report = convert_checked(tmp_path, shared_initializer_model(), node_block_list=["gemm"])
    assert {r["node"]: r["precision"] for r in report.rows}["gemm"] == "float32"
    with pytest.raises(ValueError, match="no_such_node"):
        convert_onnx(save(if_model(), tmp_path, "m.onnx"), str(tmp_path / "o.onnx"), node_block_list=["no_such_node"])


def test_keep_io_types_false_gives_fp16_inputs_and_outputs(tmp_path):
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [tensor_input("x", F32, [2, 4])],
                       [tensor_input("y", F32, [2, 4])], [initializer("w", weights(4, 4))])
    converted, path, _ = convert_checked(tmp_path, model, keep_io_types=False)
    assert converted.graph.input[0].type.tensor_type.elem_type == F16
    assert converted.graph.output[0].type.tensor_type.elem_type == F16
    assert not nodes_of(converted, "Cast")
    assert run(path, {"x": np.ones((2, 4), np.float16)})[0].dtype == np.float16


def test_bfloat16_conversion_is_valid_onnx(tmp_path):
    converted, _, report = convert_checked(tmp_path, shared_initializer_model(), dtype="bfloat16")
    assert {t.name: t.data_type for t in converted.graph.initializer}["w"] == onnx.TensorProto.BFLOAT16
    assert report.dtype == "bfloat16"


def test_level_o0_writes_the_model_unchanged(tmp_path):
    src = save(shared_initializer_model(), tmp_path, "src.onnx")
    report = convert_onnx(src, str(tmp_path / "o0.onnx"), "O0")
    written, source = onnx.load(str(tmp_path / "o0.onnx")).graph, onnx.load(src).graph
    assert report.casts == 0 and written.node == source.node and written.initializer == source.initializer


def test_bad_inputs_name_the_file_or_value(tmp_path):
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("this is not a protobuf")
    with pytest.raises(ValueError, match="notes.onnx is not an ONNX model"):
        convert_onnx(str(not_onnx), str(tmp_path / "o.onnx"))
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        convert_onnx(str(tmp_path / "missing.onnx"), str(tmp_path / "o.onnx"))
    with pytest.raises(ValueError, match="'O5'"):
        convert_onnx(save(if_model(), tmp_path, "m.onnx"), str(tmp_path / "o.onnx"), "O5")
