"""The ONNX passes one at a time, on onnx_ir models built from small onnx.helper graphs: what each pass
changes, what it counts, and what it must leave alone."""
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from amp_compiler import make_config
from amp_compiler.onnx.convert import run_onnx_pipeline
from onnx_testing import F16, F32, I64, initializer, make_model, run, tensor_input
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.fold_casts import fold_onnx_casts
from amp_compiler.passes.onnx.infer_types import infer_onnx_types
from amp_compiler.passes.onnx.lower_graph_inputs import lower_onnx_graph_inputs
from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.onnx.spec import cast_pair_folds
from amp_compiler.passes.onnx.strip_float_casts import strip_onnx_float_casts
from amp_compiler.passes.onnx.unify_input_types import unify_onnx_input_types
from amp_compiler.passes.onnx.unique_names import unique_onnx_names
from amp_compiler.passes.onnx.widen_refused_nodes import widen_refused_onnx_nodes

D = ir.DataType


def ir_model(nodes, inputs, outputs, initializers=()) -> ir.Model:
    model = onnx.shape_inference.infer_shapes(make_model(nodes, inputs, outputs, initializers))
    return ir.from_proto(model)


def ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def cast(source, target, to, name=None):
    return helper.make_node("Cast", [source], [target], to=to, name=name or target)


def test_cast_pairs_fold_only_when_exact():
    assert cast_pair_folds(D.FLOAT16, D.FLOAT, D.FLOAT16)          # widening first: exact
    assert cast_pair_folds(D.INT64, D.FLOAT, D.FLOAT16)            # ints reach fp16 the same way via fp32
    assert cast_pair_folds(D.BOOL, D.FLOAT, D.BFLOAT16)
    assert not cast_pair_folds(D.FLOAT, D.FLOAT16, D.FLOAT)        # the round trip rounds
    assert not cast_pair_folds(D.INT64, D.FLOAT, D.BFLOAT16)       # double rounding above 2**24
    assert not cast_pair_folds(D.STRING, D.FLOAT, D.FLOAT16)


def test_fold_keeps_a_rounding_round_trip_and_folds_an_exact_chain():
    model = ir_model([cast("x", "x16", F16), cast("x16", "x32", F32),           # user's rounding: kept
                      cast("ids", "ids32", F32), cast("ids32", "ids16", F16),     # int -> fp32 -> fp16: one cast
                      helper.make_node("Add", ["ids16", "x16"], ["y"], name="add")],
                     [tensor_input("x", F32, [4]), tensor_input("ids", I64, [4])],
                     [tensor_input("y", F16, [4]), tensor_input("x32", F32, [4])])
    result = fold_onnx_casts(model)
    assert result.counts == {"casts_retargeted": 1}
    casts = {n.name: (n.inputs[0].name, n.attributes["to"].as_int()) for n in model.graph if n.op_type == "Cast"}
    assert casts == {"x16": ("x", F16), "x32": ("x16", F32), "ids32": ("ids", F16)}


def test_fold_converts_weights_once_and_keeps_a_copy_for_fp32_readers():
    model = ir_model([cast("w", "w16", F16), helper.make_node("MatMul", ["x", "w16"], ["y"], name="mm"),
                      helper.make_node("Add", ["x32", "w"], ["z"], name="add")],
                     [tensor_input("x", F16, [4, 4]), tensor_input("x32", F32, [4, 4])],
                     [tensor_input("y", F16, [4, 4]), tensor_input("z", F32, [4, 4])],
                     [initializer("w", np.full((4, 4), 2.0, np.float32))])
    counts = fold_onnx_casts(model).counts
    assert counts == {"initializers_converted": 1} and "Cast" not in ops(model)
    stored = {name: v.const_value.dtype for name, v in model.graph.initializers.items()}
    assert stored == {"w": D.FLOAT, "w16": D.FLOAT16}
    assert model.graph.node("mm").inputs[1].name == "w16"


def test_fold_converts_constants_merges_duplicates_and_counts_overflow():
    big = helper.make_tensor("v", F32, [2], [1.0, 1.0e6])
    model = ir_model([helper.make_node("Constant", [], ["c"], value=big, name="const"),
                      cast("c", "c16", F16), cast("x", "xa", F16), cast("x", "xb", F16),
                      helper.make_node("Add", ["xa", "c16"], ["s"], name="add"),
                      helper.make_node("Add", ["s", "xb"], ["y"], name="add2")],
                     [tensor_input("x", F32, [2])], [tensor_input("y", F16, [2])])
    counts = fold_onnx_casts(model).counts
    assert counts["constants_converted"] == 1 and counts["duplicate_casts_merged"] == 1
    assert counts["constant_values_overflowed"] == 1          # 1e6 is inf in fp16, as ORT's Cast makes it
    assert ops(model) == ["Constant", "Cast", "Add", "Add"]


def test_strip_removes_float_casts_only_and_records_what_nodes_read():
    model = ir_model([cast("x", "x16", F16, "half"), cast("ids", "f", F32, "ids_to_float"),
                      helper.make_node("Add", ["x16", "x16"], ["y"], name="add"),
                      helper.make_node("Add", ["f", "f"], ["z"], name="add_f")],
                     [tensor_input("x", F32, [2]), tensor_input("ids", I64, [2])],
                     [tensor_input("y", F16, [2]), tensor_input("z", F32, [2])])
    result = strip_onnx_float_casts(model)
    assert result.counts == {"source_float_casts_removed": 1, "source_float_casts_kept": 0}
    assert ops(model) == ["Cast", "Add", "Add"]
    add = model.graph.node("add")
    assert add.inputs[0].name == "x" and add.meta["source_input_dtypes"] == (D.FLOAT16, D.FLOAT16)
    assert model.graph.meta["source_output_dtypes"] == (D.FLOAT16, D.FLOAT)


def test_strip_gives_a_graph_output_cast_name_back_to_its_source():
    model = ir_model([helper.make_node("Relu", ["x"], ["r"], name="relu"), cast("r", "y", F16)],
                     [tensor_input("x", F32, [2])], [tensor_input("y", F16, [2])])
    strip_onnx_float_casts(model)
    assert ops(model) == ["Relu"] and model.graph.outputs[0].name == "y"


def test_lower_graph_inputs_only_when_every_reader_wants_low():
    model = ir_model([cast("a", "a16", F16), helper.make_node("Relu", ["a16"], ["y"], name="r1"),
                      cast("b", "b16", F16), helper.make_node("Relu", ["b16"], ["z"], name="r2"),
                      helper.make_node("Relu", ["b"], ["w"], name="r3")],
                     [tensor_input("a", F32, [2]), tensor_input("b", F32, [2])],
                     [tensor_input("y", F16, [2]), tensor_input("z", F16, [2]), tensor_input("w", F32, [2])])
    assert lower_onnx_graph_inputs(model, D.FLOAT16).counts == {"graph_inputs_lowered": 1}
    assert [v.dtype for v in model.graph.inputs] == [D.FLOAT16, D.FLOAT]


def test_unify_casts_fp32_weights_of_an_fp16_layer_norm(tmp_path):
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], name="norm")]
    proto = make_model(nodes, [tensor_input("x", F16, [2, 4])], [tensor_input("y", F16, [2, 4])],
                       [initializer("gamma", np.ones(4, np.float32)), initializer("beta", np.zeros(4, np.float32))])
    model = ir.from_proto(proto)                          # what torch.onnx writes for fp16 data, fp32 weights
    assert unify_onnx_input_types(model).counts == {"mixed_dtype_inputs_cast": 2}
    fold_onnx_casts(model)
    assert {v.const_value.dtype for v in model.graph.initializers.values()} == {D.FLOAT16}
    path = str(tmp_path / "norm.onnx")
    ir.save(model, path)
    onnx.checker.check_model(path, full_check=True)


def test_widen_runs_a_refused_fp16_scatter_in_fp32(tmp_path):
    nodes = [helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="add", name="scatter")]
    proto = make_model(nodes, [tensor_input("x", F16, [4, 3]), tensor_input("i", I64, [2, 1]),
                               tensor_input("u", F16, [2, 3])], [tensor_input("y", F16, [4, 3])])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    assert widen_refused_onnx_nodes(model).counts == {"refused_nodes_widened": 1}
    assert ops(model) == ["Cast", "Cast", "ScatterND", "Cast"] and model.graph.outputs[0].name == "y"
    path = str(tmp_path / "scatter.onnx")
    ir.save(model, path)
    onnx.checker.check_model(path, full_check=True)
    (out,) = run(path, {"x": np.zeros((4, 3), np.float16), "i": np.array([[0], [0]]), "u": np.ones((2, 3), np.float16)})
    assert out.dtype == np.float16 and out[0].tolist() == [2, 2, 2]


def test_infer_refuses_a_rewrite_that_onnx_types_differently():
    model = ir_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                      helper.make_node("Relu", ["r"], ["y"], name="relu2")],
                     [tensor_input("x", F32, [2])], [tensor_input("y", F32, [2])])
    model.graph.node("relu").outputs[0].type = ir.TensorType(D.FLOAT16)      # a rewrite bug
    with pytest.raises(RuntimeError, match="r: inferred FLOAT, rewrite meant FLOAT16"):
        infer_onnx_types(model, verify_rewrite=True)


def test_infer_names_the_node_onnx_cannot_type():
    model = ir_model([helper.make_node("Add", ["x", "h"], ["y"], name="mixed_add")],
                     [tensor_input("x", F32, [2]), tensor_input("h", F32, [2])], [tensor_input("y", F32, [2])])
    model.graph.inputs[1].type = ir.TensorType(D.FLOAT16)                    # a rewrite that forgot a Cast
    with pytest.raises(RuntimeError, match="ONNX type inference failed on the rewritten model: .*mixed_add"):
        infer_onnx_types(model, verify_rewrite=True)


def test_infer_hands_large_weights_to_onnx_without_their_bytes():
    """Weights above 1 KB reach onnx as typed inputs (a 2 GB model must not be serialized whole); data
    propagation never reads them, and the model gets its initializers back unchanged and in order."""
    ids = np.arange(300, dtype=np.int64)                    # 2400 bytes: Unsqueeze would propagate its data
    model = ir_model([helper.make_node("Unsqueeze", ["ids", "axes"], ["ids2"], name="unsqueeze"),
                      helper.make_node("Cast", ["ids2"], ["idsf"], to=F32, name="to_float"),
                      helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                      helper.make_node("Add", ["h", "idsf"], ["y"], name="add")],
                     [tensor_input("x", F32, [1, 300])], [tensor_input("y", F32, None)],
                     [initializer("ids", ids), initializer("axes", np.array([0], np.int64)),
                      initializer("w", np.ones((300, 300), np.float32))])
    before = [(name, v.const_value) for name, v in model.graph.initializers.items()]
    assert infer_onnx_types(model, verify_rewrite=True).counts == {"values_typed_without_schema": 0}
    assert [(name, v.const_value) for name, v in model.graph.initializers.items()] == before
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert model.graph.node("unsqueeze").outputs[0].shape == ir.Shape([1, 300])
    assert model.graph.outputs[0].shape == ir.Shape([1, 300])    # an undeclared output shape is filled in


def test_unique_names_keep_the_interface_and_are_stable():
    model = ir_model([helper.make_node("Relu", ["x"], ["y1"]), helper.make_node("Relu", ["x"], ["y2"])],
                     [tensor_input("x", F32, [2])], [tensor_input("y1", F32, [2]), tensor_input("y2", F32, [2])])
    assert unique_onnx_names(model).counts == {"names_made_unique": 2}
    assert [n.name for n in model.graph] == ["Relu", "Relu_1"] and model.graph.inputs[0].name == "x"
    assert unique_onnx_names(model).counts == {"names_made_unique": 0}


def _decide(model, level="O1", dtype="float16", **options):
    onnx_canonicalize(model)
    low = D.FLOAT16 if dtype == "float16" else D.BFLOAT16
    decide_onnx_precision(model, make_config(level, dtype=dtype).precision_rules(), low, **options)
    return {n.name: (n.meta["amp"]["precision"], n.meta["amp"]["rule"]) for n in model.graph}


def test_decide_keeps_ops_the_runtime_or_the_schema_cannot_run_low():
    model = ir_model([helper.make_node("ScatterND", ["x", "i", "u"], ["s"], reduction="max", name="scatter"),
                      helper.make_node("Conv", ["s4", "w"], ["y"], name="conv")],
                     [tensor_input("x", F32, [4, 3]), tensor_input("i", I64, [2, 1]), tensor_input("u", F32, [2, 3]),
                      tensor_input("s4", F32, [1, 1, 4, 3])],
                     [tensor_input("s", F32, [4, 3]), tensor_input("y", F32, None)],
                     [initializer("w", np.ones((1, 1, 1, 1), np.float32))])
    fp16 = _decide(model, "O3")
    assert fp16["scatter"][0] == "fp32" and "no float16 ScatterND kernel with reduction='max'" in fp16["scatter"][1]
    assert fp16["conv"][0] == "low"
    bf16 = _decide(model, "O3", "bfloat16")      # opset 18 Conv has no bfloat16 in its type constraint
    assert bf16["conv"] == ("fp32", "the ONNX schema of Conv takes no tensor(bfloat16) for input 0: kept fp32")


def test_pipeline_at_o0_changes_nothing():
    model = ir_model([helper.make_node("MatMul", ["x", "x"], ["y"], name="mm")], [tensor_input("x", F32, [2, 2])],
                     [tensor_input("y", F32, [2, 2])])
    assert run_onnx_pipeline(model, make_config("O0")) == {} and ops(model) == ["MatMul"]


def test_unknown_typed_values_are_left_alone(tmp_path):
    """A custom-domain op has no schema: its output's type is unknown, so its readers are not painted."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Mystery", ["h"], ["m"], domain="com.example", name="custom"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    proto = make_model(nodes, [tensor_input("x", F32, [2, 2])], [tensor_input("y", F32, [2, 2])],
                       [initializer("w", np.ones((2, 2), np.float32))])
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    model = ir.from_proto(proto)
    run_onnx_pipeline(model, make_config("O1"))
    decided = {n.name: n.meta["amp"].get("precision") for n in model.graph if "amp" in n.meta}
    assert decided["mm"] == "low" and decided["relu"] is None
    assert model.graph.node("custom").inputs[0].dtype == D.FLOAT           # it still reads what it read
