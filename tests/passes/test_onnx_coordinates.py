"""onnx/coordinates.py: which readers take a value as data (input 0, every input of Concat, Where's branches)
rather than as indices (Gather's) or a condition, and the hook that keeps positions computed from Range fp32 at
O2 with the sampler reading them; a Range read as indices keeps nothing fp32."""
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.onnx.coordinates import keep_onnx_coordinates_fp32, readers_as_data
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.policy.rules import PrecisionRules
from onnx_testing import F32, I64, initializer, make_model, tensor_input


def warp() -> ir.Model:
    """positions = Range(0, 4) + MatMul(x, w) (a predicted flow); Concat'd into a grid that GridSample reads."""
    nodes = [helper.make_node("Range", ["start", "limit", "delta"], ["pos"], name="range"),
             helper.make_node("MatMul", ["x", "w"], ["flow"], name="flow"),
             helper.make_node("Add", ["flow", "pos"], ["moved"], name="add"),
             helper.make_node("Div", ["moved", "half"], ["scaled"], name="div"),
             helper.make_node("Reshape", ["scaled", "shape"], ["col"], name="reshape"),
             helper.make_node("Concat", ["col", "col"], ["grid"], axis=-1, name="concat"),
             helper.make_node("Reshape", ["grid", "grid_shape"], ["grid4"], name="reshape_grid"),
             helper.make_node("GridSample", ["image", "grid4"], ["sampled"], name="grid_sample"),
             helper.make_node("MatMul", ["sampled", "w_out"], ["y"], name="out")]
    inits = [initializer("start", np.array(0.0, np.float32)), initializer("limit", np.array(4.0, np.float32)),
             initializer("delta", np.array(1.0, np.float32)), initializer("w", np.ones((4, 4), np.float32)),
             initializer("half", np.array(2.0, np.float32)), initializer("shape", np.array([1, 4, 4, 1])),
             initializer("grid_shape", np.array([1, 4, 4, 2])), initializer("w_out", np.ones((4, 4), np.float32))]
    proto = make_model(nodes, [tensor_input("x", F32, [4, 4]), tensor_input("image", F32, [1, 1, 4, 4])],
                       [tensor_input("y", F32, None)], inits)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def indexing() -> ir.Model:
    nodes = [helper.make_node("Range", ["start", "limit", "delta"], ["idx"], name="range"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Gather", ["h", "idx"], ["picked"], axis=1, name="gather"),
             helper.make_node("Mul", ["picked", "picked"], ["sq"], name="mul"),
             helper.make_node("Where", ["cond", "sq", "h"], ["y"], name="where")]
    inits = [initializer("start", np.array(0, np.int64)), initializer("limit", np.array(4, np.int64)),
             initializer("delta", np.array(1, np.int64)), initializer("w", np.ones((4, 4), np.float32))]
    proto = make_model(nodes, [tensor_input("x", F32, [4, 4]), tensor_input("cond", onnx.TensorProto.BOOL, [4, 4])],
                       [tensor_input("y", F32, [4, 4])], inits)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    onnx_canonicalize(model)
    return model


def as_data(model, name) -> dict:
    return {reader.name: data for reader, data in readers_as_data(model.graph.node(name))}


def test_readers_as_data_tells_data_from_indices_and_conditions():
    model = indexing()
    assert as_data(model, "range") == {"gather": False}          # Gather's input 1: indices
    assert as_data(model, "mm") == {"gather": True, "where": True}   # Gather's data; Where's second branch
    assert as_data(model, "mul") == {"where": True}
    model = warp()
    onnx_canonicalize(model)
    assert as_data(model, "reshape") == {"concat": True}         # both of Concat's inputs are data
    assert as_data(model, "range") == {"add": False}   # Add's input 1: arithmetic carries a position either way


def decided(model, hook=True) -> dict:
    onnx_canonicalize(model)
    painted = [keep_onnx_coordinates_fp32(model.graph)] if hook else []
    decide_onnx_precision(model, PrecisionRules.build("O2", "float16"), ir.DataType.FLOAT16, painted=painted)
    return {n.name: (n.meta["amp"]["precision"], n.meta["amp"]["rule"]) for n in model.graph}


def test_positions_from_range_and_the_sampler_reading_them_run_fp32_at_o2():
    f = decided(warp())
    for name in ("add", "div", "reshape", "concat", "reshape_grid"):
        assert f[name][0] == "fp32" and f[name][1].startswith("coordinates: a position computed from range "), \
            (name, f[name])
    assert f["grid_sample"][0] == "fp32" and "reads the coordinates reshape_grid" in f["grid_sample"][1]
    assert f["flow"][0] == f["out"][0] == "low"


def test_without_the_hook_o2_paints_them_low():
    f = decided(warp(), hook=False)
    assert f["add"][0] == f["grid_sample"][0] == "low"


def test_a_range_read_as_indices_keeps_nothing_fp32():
    assert decided(indexing()) == decided(indexing(), hook=False)
    assert decided(indexing())["mul"][0] == "low"
