"""onnx/place_casts.py: the ValueFlow of an ONNX graph (fp32 bytes per value, a named dim counted as 32) for
the byte-counting placement hook: a Slice that painting lowered moves to fp32 when that casts its small
output instead of its large input; where moving gains nothing, or the model has a subgraph, nothing moves."""
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.place_casts import INPUT, OUTPUT, SYMBOLIC_DIM, OnnxCastPlacement, fp32_bytes
from amp_compiler.passes.policy.rules import PrecisionRules
from onnx_testing import F32, initializer, make_model, tensor_input

RULES = PrecisionRules.build("O1", "float16")


def sliced(rows: int = 64, kept: int = 2, branch=False) -> ir.Model:
    """x (fp32, rows x 64) -> Slice (its first `kept` rows) -> MatMul (low at O1) -> y."""
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"], name="slice"),
             helper.make_node("MatMul", ["s", "w"], ["y"], name="matmul")]
    inputs = [tensor_input("x", F32, [rows, 64])]
    outputs = [tensor_input("y", F32, [kept, 8])]
    if branch:
        then = helper.make_graph([helper.make_node("Identity", ["y"], ["z"], name="inner")], "then", [],
                                 [tensor_input("z", F32, [kept, 8])])
        nodes.append(helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=then, name="if"))
        inputs.append(tensor_input("c", onnx.TensorProto.BOOL, []))
        outputs.append(tensor_input("out", F32, [kept, 8]))
    proto = make_model(nodes, inputs, outputs,
                       [initializer("starts", np.array([0])), initializer("ends", np.array([kept])),
                        initializer("axes", np.array([0])), initializer("w", np.ones((64, 8), np.float32))])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    onnx_canonicalize(model)
    return model


def decided(model, placement=True):
    hook = OnnxCastPlacement(model, keep_io_types=True)
    decide_onnx_precision(model, RULES, ir.DataType.FLOAT16, painted=[hook] if placement else [])
    return {n.name: (n.meta["amp"]["precision"], n.meta["amp"]["rule"]) for n in model.graph}, hook.counts


def test_fp32_bytes_count_a_named_dim_as_32():
    value = ir.Value(name="v", type=ir.TensorType(ir.DataType.FLOAT16), shape=ir.Shape(["batch", 3, 4]))
    assert fp32_bytes(value) == SYMBOLIC_DIM * 3 * 4 * 4
    assert fp32_bytes(ir.Value(name="u", type=ir.TensorType(ir.DataType.FLOAT))) is None     # no shape
    assert fp32_bytes(ir.Value(name="i", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([2]))) is None


def test_the_value_flow_holds_inputs_nodes_and_the_output_with_their_bytes_and_readers():
    model = sliced()
    hook = OnnxCastPlacement(model, keep_io_types=True)
    flow = hook.value_flow({"slice": {}, "matmul": {}})
    assert flow.value_bytes == {INPUT + "x": 64 * 64 * 4, "slice": 2 * 64 * 4, "matmul": 2 * 8 * 4}
    assert flow.readers == {INPUT + "x": ["slice"], "slice": ["matmul"], "matmul": [OUTPUT]}
    assert flow.fixed == {OUTPUT: "fp32", INPUT + "x": "fp32"}
    assert flow.movable == {"slice", "matmul"}   # the weight is an initializer: free to read either way


def test_a_lowered_slice_of_a_large_input_moves_to_fp32():
    before, _ = decided(sliced(), placement=False)
    assert before["slice"][0] == "low"   # painting: a clear op joined to the low MatMul
    after, counts = decided(sliced())
    assert after["slice"] == ("fp32", f"placement: 16.4 KB cast -> 512 B ({before['slice'][1]})")
    assert after["matmul"] == before["matmul"]
    assert counts == {"bytes_cast_before": 64 * 64 * 4 + 64, "bytes_cast_after": 2 * 64 * 4 + 64, "nodes_moved": 1}


def test_where_moving_gains_nothing_the_painting_stays():
    placed, counts = decided(sliced(rows=2))   # the slice keeps every row: its input and output are the same size
    painted, _ = decided(sliced(rows=2), placement=False)
    assert placed == painted and placed["slice"][0] == "low"
    assert counts == {"bytes_cast_before": 2 * 64 * 4 + 64, "bytes_cast_after": 2 * 64 * 4 + 64, "nodes_moved": 0}


def test_a_model_with_a_subgraph_is_left_as_painted():
    placed, counts = decided(sliced(branch=True))
    painted, _ = decided(sliced(branch=True), placement=False)
    assert placed == painted and counts == {}
