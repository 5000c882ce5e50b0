"""onnxconverter-common's float16 tests (microsoft/onnxconverter-common, tests/test_float16.py) and onnxruntime's
(onnxruntime/test/python/transformers/test_float16.py: Resize/Upsample chains), ported to
convert_onnx. Their models are rebuilt with onnx.helper (the originals use onnx_fx tracing and two data
files); each is converted with keep_io_types True and False, checked, run, and compared with the fp32
model in ONNX Runtime with their tolerance (np.allclose, atol 1e-2 where they give one)."""
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from amp_compiler import convert_onnx
from onnx_testing import BOOL, F16, F32, I64, assert_valid, initializer, make_model, run, save, tensor_input

RNG = np.random.default_rng(0)


def constant(name: str, array) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name),
                            name=f"const_{name}")


def convert_both_ways(tmp_path, model, feeds: dict, *, atol: float = 1e-8, level: str = "O1"):
    """oc's pattern: fp32 reference, then keep_io_types=False (fp16 where the model says) and True."""
    src = save(model, tmp_path, "fp32.onnx")
    expected = run(src, feeds)
    results = {}
    for keep in (False, True):
        dst = str(tmp_path / f"fp16_keep_{keep}.onnx")
        convert_onnx(src, dst, level, keep_io_types=keep)
        assert_valid(dst)
        # keep_io_types=False: an input arrives in fp16 when all its readers run low (oc makes every float
        # input fp16); feed what the converted model declares, as oc's tests feed what theirs declares.
        declared = {i.name: i.type.tensor_type.elem_type for i in onnx.load(dst).graph.input}
        typed = {k: v.astype(np.float16) if declared[k] == F16 else v for k, v in feeds.items()}
        actual = run(dst, typed)
        outputs = [o.type.tensor_type.elem_type for o in onnx.load(dst).graph.output]
        for want, got, elem_type in zip(expected, actual, outputs):
            assert got.dtype == (np.float32 if keep or elem_type == F32 else np.float16)
            assert np.allclose(want, got, atol=atol, rtol=1e-3 if atol < 1e-3 else 1e-2), (keep, want, got)
        results[keep] = actual
    return results


# test_float16: Transpose, a Constant weight transposed, MatMul, Min (opset 9, exact small integers).
def transpose_matmul_model():
    nodes = [constant("wm", np.arange(1, 13, dtype=np.float32).reshape(2, 6)),
             helper.make_node("Transpose", ["x"], ["a"], perm=[0, 1, 3, 2], name="transpose_x"),
             helper.make_node("Transpose", ["wm"], ["c"], perm=[1, 0], name="transpose_w"),
             helper.make_node("MatMul", ["a", "c"], ["d"], name="matmul"),
             helper.make_node("Min", ["d"], ["z"], name="min")]
    return make_model(nodes, [tensor_input("x", F32, [1, 1, 6, 1])], [tensor_input("z", F32, None)], opset=9)


def test_float16_transpose_matmul(tmp_path):
    x = np.array([[2, 3], [4, 5], [6, 7]], np.float32).reshape(1, 1, 6, 1)
    results = convert_both_ways(tmp_path, transpose_matmul_model(), {"x": x})
    assert results[True][0].tolist() == [[[[1 * 2 + 2 * 3 + 3 * 4 + 4 * 5 + 5 * 6 + 6 * 7,
                                            7 * 2 + 8 * 3 + 9 * 4 + 10 * 5 + 11 * 6 + 12 * 7]]]]


# test_float16_with_loop: a Loop that gathers rows of an outer value, with a loop-carried total and a scan output.
def loop_model():
    body = helper.make_graph(
        [helper.make_node("Gather", ["data", "iter_n"], ["col"], axis=0, name="gather_row"),
         helper.make_node("Add", ["total_in", "col"], ["total_out"], name="add_row"),
         helper.make_node("Identity", ["total_out"], ["scan_out"], name="scan"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going")],
        "range_body", [tensor_input("iter_n", I64, []), tensor_input("cond_in", BOOL, []),
                       tensor_input("total_in", F32, [None])],
        [tensor_input("cond_out", BOOL, []), tensor_input("total_out", F32, [None]),
         tensor_input("scan_out", F32, [None])])
    nodes = [helper.make_node("Shape", ["data"], ["shape"], name="shape"),
             constant("zero", np.array(0, np.int64)), constant("one", np.array([1], np.int64)),
             helper.make_node("Gather", ["shape", "zero"], ["dim_0"], axis=0, name="rows"),
             helper.make_node("Gather", ["shape", "one"], ["dim_1"], axis=0, name="columns"),
             helper.make_node("ConstantOfShape", ["dim_1"], ["zeros"],
                              value=helper.make_tensor("v", F32, [1], [0.0]), name="zeros"),
             constant("is_true", np.array(True)),
             helper.make_node("Loop", ["dim_0", "is_true", "zeros"], ["final_total", "scan_res"], body=body,
                              name="loop")]
    return make_model(nodes, [tensor_input("data", F32, [None, None])],
                      [tensor_input("final_total", F32, [None]), tensor_input("scan_res", F32, [None, None])])


def test_float16_with_loop(tmp_path):
    data = np.array([[2, 3], [4, 5], [6, 7]], np.float32)
    results = convert_both_ways(tmp_path, loop_model(), {"data": data})
    final, scanned = results[True]
    assert final.tolist() == [12, 15] and scanned.tolist() == [[2, 3], [6, 8], [12, 15]]


# test_convert_to_float16: image_classifier32.onnx, a torch-jit export (opset 11, IR 7): Conv, Relu, MaxPool,
# two Resize whose sizes come from Shape/Slice/Concat of Constants, Reshape, Gemm; a dynamic batch.
def image_classifier_model():
    nodes = [helper.make_node("Conv", ["modelInput", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1],
                              name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool")]
    source = "p"
    for i, size in enumerate((20, 10)):
        nodes += [helper.make_node("Shape", [source], [f"shape{i}"], name=f"shape{i}"),
                  constant(f"start{i}", np.array([0], np.int64)), constant(f"end{i}", np.array([2], np.int64)),
                  helper.make_node("Slice", [f"shape{i}", f"start{i}", f"end{i}"], [f"nc{i}"], name=f"slice{i}"),
                  constant(f"hw{i}", np.array([size, size], np.int64)),
                  helper.make_node("Concat", [f"nc{i}", f"hw{i}"], [f"sizes{i}"], axis=0, name=f"concat{i}"),
                  constant(f"roi{i}", np.array([], np.float32)), constant(f"scales{i}", np.array([], np.float32)),
                  helper.make_node("Resize", [source, f"roi{i}", f"scales{i}", f"sizes{i}"], [f"up{i}"],
                                   mode="nearest", coordinate_transformation_mode="asymmetric",
                                   nearest_mode="floor", name=f"resize{i}")]
        source = f"up{i}"
    nodes += [constant("flat", np.array([-1, 1200], np.int64)),
              helper.make_node("Reshape", [source, "flat"], ["flattened"], name="reshape"),
              helper.make_node("Gemm", ["flattened", "fc1.weight", "fc1.bias"], ["modelOutput"], transB=1,
                               name="fc1")]
    inits = [initializer("conv.weight", RNG.standard_normal((12, 3, 3, 3)).astype(np.float32) * 0.2),
             initializer("conv.bias", RNG.standard_normal(12).astype(np.float32) * 0.1),
             initializer("fc1.weight", RNG.standard_normal((10, 1200)).astype(np.float32) * 0.05),
             initializer("fc1.bias", RNG.standard_normal(10).astype(np.float32) * 0.1)]
    model = make_model(nodes, [tensor_input("modelInput", F32, ["batch_size", 3, 32, 32])],
                       [tensor_input("modelOutput", F32, ["batch_size", 10])], inits, opset=11)
    model.ir_version = 7
    return model


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_convert_image_classifier(tmp_path, level):
    x = RNG.random((1, 3, 32, 32)).astype(np.float32)
    convert_both_ways(tmp_path, image_classifier_model(), {"modelInput": x}, atol=1e-2, level=level)
    converted = onnx.load(str(tmp_path / "fp16_keep_True.onnx"))
    stored = {t.name: t.data_type for t in converted.graph.initializer}
    assert stored["conv.weight"] == stored["fc1.weight"] == F16


# test_convert_to_float16_with_truncated: oc clamps [1e-10, -2, 15, -1e-9, 65536.1, -100000] to [1e-7, 1e4];
# convert_onnx clips nothing: the reader of a constant beyond fp16's range stays fp32 and the values exact.
def test_values_beyond_fp16_are_never_truncated(tmp_path):
    values = np.array([1e-10, -2.0, 15, -1e-9, 65536.1, -100000], np.float32)
    nodes = [helper.make_node("Mul", ["x", "scale"], ["y"], name="mul"),
             helper.make_node("MatMul", ["y", "w"], ["z"], name="matmul")]
    model = make_model(nodes, [tensor_input("x", F32, [2, 6])], [tensor_input("z", F32, [2, 3])],
                       [initializer("scale", values), initializer("w", RNG.standard_normal((6, 3)).astype(np.float32))])
    src, dst = save(model, tmp_path, "src.onnx"), str(tmp_path / "dst.onnx")
    report = convert_onnx(src, dst)
    assert {r["node"]: r["precision"] for r in report.rows}["mul"] == "float32"
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(dst).graph.initializer}
    assert np.array_equal(stored["scale"], values)
    x = RNG.standard_normal((2, 6)).astype(np.float32) * 1e-3
    (out,), (ref,) = run(dst, {"x": x}), run(src, {"x": x})
    assert np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2, atol=1e-2)


# test_convert_to_float16_with_subgraph: test_subgraph.onnx (opset 17), an If whose then-branch reads an outer
# value through ReduceMax and Max, with CastLike of int64 constants in both scopes.
def subgraph_model():
    then_branch = helper.make_graph(
        [helper.make_node("ReduceMax", ["a"], ["b"], keepdims=0, name="reduce_max"),
         constant("int64_0_0", np.array(0, np.int64)),
         helper.make_node("CastLike", ["int64_0_0", "b"], ["int64_0_0_cast"], name="castlike_then"),
         helper.make_node("Max", ["b", "int64_0_0_cast"], ["c"], name="max"),
         constant("int64_0_1", np.array(0, np.int64)),
         helper.make_node("Unsqueeze", ["c", "int64_0_1"], ["result"], name="unsqueeze")],
        "thenGraph_4", [], [tensor_input("result", F32, None)])
    else_branch = helper.make_graph([helper.make_node("Identity", ["a"], ["result_2"], name="identity")],
                                    "elseGraph_4", [], [tensor_input("result_2", F32, None)])
    nodes = [helper.make_node("Add", ["x", "y"], ["a"], name="add"),
             constant("int64_0", np.array(0, np.int64)),
             helper.make_node("CastLike", ["int64_0", "a"], ["int64_0_cast"], name="castlike"),
             helper.make_node("Greater", ["a", "int64_0_cast"], ["cond"], name="greater"),
             helper.make_node("If", ["cond"], ["result_3"], then_branch=then_branch, else_branch=else_branch,
                              name="if")]
    model = make_model(nodes, [tensor_input("x", F32, [1]), tensor_input("y", F32, [1])],
                       [tensor_input("result_3", F32, None)], opset=17)
    model.ir_version = 8
    return model


@pytest.mark.parametrize("x", [1.0, -5.0])   # both branches
def test_convert_with_subgraph(tmp_path, x):
    feeds = {"x": np.array([x], np.float32), "y": np.array([2.0], np.float32)}
    results = convert_both_ways(tmp_path, subgraph_model(), feeds, atol=1e-2)
    assert results[True][0].tolist() == [max(x + 2.0, 0.0) if x + 2.0 > 0 else x + 2.0]


# onnxruntime's float16 tests (onnxruntime/test/python/transformers/test_float16.py): chains of unnamed Resize
# (opset 11: X, roi, scales; opset 10: X, scales) and Upsample (opset 9) nodes with value_info everywhere.
def resize_chain_model(opset: int, count: int, op_type: str = "Resize", named: bool = False):
    nodes, inits, previous = [], [], "input"
    for i in range(count):
        output = f"out_{i}" if i < count - 1 else "output"
        own = [f"roi_{i}", f"scales_{i}"] if op_type == "Resize" and opset >= 11 else [f"scales_{i}"]
        nodes.append(helper.make_node(op_type, [previous, *own], [output], mode="nearest",
                                      name=f"{op_type}_{i}" if named else ""))
        if len(own) == 2:
            inits.append(initializer(f"roi_{i}", np.array([], np.float32)))
        inits.append(initializer(f"scales_{i}", np.array([1.0, 1.0, 2.0, 2.0], np.float32)))
        previous = output
    side = 4 * 2 ** count
    model = make_model(nodes, [tensor_input("input", F32, [1, 1, 4, 4])], [tensor_input("output", F32, [1, 1, side, side])],
                       inits, opset=opset)
    model.ir_version = 7
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("opset, op_type", [(11, "Resize"), (10, "Resize"), (9, "Upsample")])
@pytest.mark.parametrize("level", ["O1", "O3"])
def test_resize_chains_keep_scales_fp32_and_names_unique(tmp_path, opset, op_type, level):
    src, dst = save(resize_chain_model(opset, 3, op_type), tmp_path, "src.onnx"), str(tmp_path / "dst.onnx")
    convert_onnx(src, dst, level)
    assert_valid(dst)   # unique node names, clean casts, sorted, checker
    converted = onnx.load(dst)
    stored = {t.name: t.data_type for t in converted.graph.initializer}
    assert all(stored[name] == F32 for name in stored if name.startswith(("scales_", "roi_")))
    outputs = [o for n in converted.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    x = RNG.standard_normal((1, 1, 4, 4)).astype(np.float32)
    (out,), (ref,) = run(dst, {"input": x}), run(src, {"input": x})
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_resize_in_op_block_list_and_fp16_data_input(tmp_path):
    src = save(resize_chain_model(11, 2), tmp_path, "src.onnx")
    report = convert_onnx(src, str(tmp_path / "blocked.onnx"), "O3", op_block_list=["Resize"])
    assert all(r["precision"] == "float32" for r in report.rows if r["op_type"] == "Resize")
    assert_valid(str(tmp_path / "blocked.onnx"))
    convert_onnx(src, str(tmp_path / "low_io.onnx"), "O3", keep_io_types=False)   # oc/ORT: the data input is fp16
    converted = onnx.load(str(tmp_path / "low_io.onnx"))
    assert converted.graph.input[0].type.tensor_type.elem_type == F16
    x = RNG.standard_normal((1, 1, 4, 4)).astype(np.float32)
    (out,), (ref,) = run(str(tmp_path / "low_io.onnx"), {"input": x.astype(np.float16)}), run(src, {"input": x})
    assert out.dtype == np.float16 and np.allclose(out, ref, rtol=1e-2, atol=1e-2)
