"""store_moved_onnx_weights_low: a weight that fp32 ops only move (an embedding table read by a Gather that
feeds fp32 arithmetic: an Add into a Softmax, fp32 at O1) is stored in fp16, the Gather runs low and one Cast lifts the gathered rows;
weights it must not touch keep fp32. Each end-to-end case is validated and converted twice."""
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from amp_compiler import convert_onnx, make_config
from onnx_testing import (F16, F32, I64, assert_valid, initializer, input_types, make_model, nodes_of, run,
                          same_model, save, tensor_input, value_types)
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.onnx.store_moved_weights_low import store_moved_onnx_weights_low

RNG = np.random.default_rng(0)
IDS = np.array([[0, 3, 7, 3], [1, 2, 2, 5]], np.int64)


def lookup_model(table=None, *, extra_reader=None):
    """rows = Gather(table, ids) -> Add(pos) -> Softmax -> MatMul: painting keeps the Gather fp32 (since O1 runs
    norms on fp16 activations, a Softmax is what keeps the Add fp32 here)."""
    table = RNG.standard_normal((8, 4)).astype(np.float32) if table is None else table
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
             helper.make_node("Add", ["rows", "pos"], ["summed"], name="add_pos"),
             helper.make_node("Softmax", ["summed"], ["normed"], axis=-1, name="norm"),
             helper.make_node("MatMul", ["normed", "w"], ["y"], name="head")]
    outputs = [tensor_input("y", F32, [2, 4, 3])]
    if extra_reader is not None:
        nodes.append(extra_reader)
        outputs.append(tensor_input(extra_reader.output[0], F32, None))
    inits = [initializer("table", table), initializer("pos", RNG.standard_normal((4, 4)).astype(np.float32)),
             initializer("w", RNG.standard_normal((4, 3)).astype(np.float32))]
    return make_model(nodes, [tensor_input("ids", I64, [2, 4])], outputs, inits)


def convert_twice(tmp_path, model, **options):
    src = save(model, tmp_path, "src.onnx")
    dst, again = str(tmp_path / "fp16.onnx"), str(tmp_path / "fp16_again.onnx")
    report = convert_onnx(src, dst, "O1", **options)
    assert_valid(dst)
    convert_onnx(dst, again, "O1", **options)
    assert same_model(dst, again), "converting a converted model must change nothing"
    return onnx.load(dst), dst, src, report


def stored_dtypes(model: onnx.ModelProto) -> dict[str, int]:
    return {t.name: t.data_type for t in model.graph.initializer}


def decided(model: ir.Model, **options) -> dict[str, tuple]:
    onnx_canonicalize(model)
    decide_onnx_precision(model, make_config("O1").precision_rules(), ir.DataType.FLOAT16, **options)
    counts = store_moved_onnx_weights_low(model, ir.DataType.FLOAT16, make_config("O1").precision_rules()).counts
    return counts, {n.name: (n.meta["amp"]["precision"], n.meta["amp"]["rule"]) for n in model.graph if "amp" in n.meta}


def test_the_pass_repaints_the_fp32_lookup_and_says_why():
    counts, precision = decided(ir.from_proto(onnx.shape_inference.infer_shapes(lookup_model())))
    assert counts == {"moved_weights_stored_low": 1, "weight_movers_lowered": 1}
    assert precision["lookup"] == ("low", "clear: only moves weight table, stored in float16 (storage rounding "
                                          "only); one Cast up for its fp32 readers")
    assert precision["add_pos"][0] == precision["norm"][0] == "fp32"      # nothing else changes


def test_an_embedding_table_is_stored_fp16_with_one_cast_of_the_rows(tmp_path):
    model = lookup_model()
    converted, path, src, report = convert_twice(tmp_path, model)
    stored = stored_dtypes(converted)
    assert stored["table"] == F16 and stored["w"] == F16 and stored["pos"] == F32
    casts = [(c.input[0], c.attribute[0].i) for c in nodes_of(converted, "Cast")]
    assert casts.count(("rows", F32)) == 1                     # the gathered rows, once, up to fp32
    assert input_types(converted, nodes_of(converted, "Gather")[0])[0] == F16
    assert input_types(converted, nodes_of(converted, "Softmax")[0])[0] == F32
    assert report.pass_counts["store_moved_weights_low"]["moved_weights_stored_low"] == 1
    assert "weights only moved by fp32 ops (embedding tables...): 1 stored in float16" in str(report)
    assert {r["node"]: r["precision"] for r in report.rows}["lookup"] == "float16"
    (out,), (ref,) = run(path, {"ids": IDS}), run(src, {"ids": IDS})
    assert out.dtype == np.float32 and np.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_a_table_beyond_fp16_range_stays_fp32_and_exact(tmp_path):
    table = RNG.standard_normal((8, 4)).astype(np.float32)
    table[5, 0] = 1.0e5
    converted, path, src, report = convert_twice(tmp_path, lookup_model(table))
    assert stored_dtypes(converted)["table"] == F32
    assert "65504" in {r["node"]: r["rule"] for r in report.rows}["lookup"]
    assert report.pass_counts["store_moved_weights_low"]["moved_weights_stored_low"] == 0
    ids = np.full((2, 4), 5, np.int64)
    (out,), (ref,) = run(path, {"ids": ids}), run(src, {"ids": ids})
    assert np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("reader, why", [
    (helper.make_node("Add", ["table", "table"], ["doubled"], name="arithmetic"), "an fp32 Add computes on it"),
    (helper.make_node("Concat", ["table", "extra"], ["joined"], axis=0, name="concat"),
     "moving it low would round the fp32 input it is joined with"),
], ids=["arithmetic", "concat"])
def test_a_table_with_another_fp32_reader_stays_fp32(tmp_path, reader, why):
    model = lookup_model(extra_reader=reader)
    if "extra" in reader.input:
        model.graph.input.append(tensor_input("extra", F32, [1, 4]))
    converted, *_ = convert_twice(tmp_path, model)
    assert stored_dtypes(converted)["table"] == F32, why
    assert value_types(converted)["rows"] == F32


def test_a_blocked_lookup_keeps_fp32(tmp_path):
    converted, _, _, report = convert_twice(tmp_path, lookup_model(), node_block_list=["lookup"])
    assert stored_dtypes(converted)["table"] == F32
    assert {r["node"]: r["rule"] for r in report.rows}["lookup"] == "node_block_list: lookup"
