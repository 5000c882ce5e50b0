"""onnx/cast_nodes.py: Casts built where their value becomes available, named after it and unique across the
model; a graph output cast keeps the output's name; a bypassed Cast hands its readers (or its output name) to
its source; a node run fp32 between casts; the one low dtype of a node's data inputs."""
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from amp_compiler.passes.onnx.cast_nodes import (UniqueNames, bypass_cast, cast_graph_output, cast_target, is_cast,
                                                 low_data_dtype, make_cast, run_fp32_between_casts)
from onnx_testing import F16, F32, initializer, make_model, tensor_input

D = ir.DataType


def ir_model(nodes, inputs, outputs, initializers=()) -> ir.Model:
    return ir.from_proto(onnx.shape_inference.infer_shapes(make_model(nodes, inputs, outputs, initializers)))


def relu_model(dtype=F32) -> ir.Model:
    return ir_model([helper.make_node("Relu", ["x"], ["h"], name="relu"),
                     helper.make_node("Neg", ["h"], ["y"], name="neg")],
                    [tensor_input("x", dtype, [2, 3])], [tensor_input("y", dtype, [2, 3])])


def check(model: ir.Model) -> None:
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def order(model) -> list[str]:
    return [n.name for n in model.graph]


def test_a_cast_goes_right_after_the_producer_or_first_for_a_graph_input():
    model = relu_model()
    names = UniqueNames(model)
    h = model.graph.node("relu").outputs[0]
    cast = make_cast(h, D.FLOAT16, names)
    assert order(model) == ["relu", "h_float16", "neg"]
    assert is_cast(cast) and cast_target(cast) == D.FLOAT16 and cast.outputs[0].name == "h_float16"
    assert cast.outputs[0].dtype == D.FLOAT16 and list(cast.outputs[0].shape) == [2, 3]
    first = make_cast(model.graph.inputs[0], D.FLOAT16, names)
    assert order(model)[0] == first.name == "x_float16"
    again = make_cast(h, D.FLOAT16, names)   # a second cast of the same value gets a fresh name
    assert again.outputs[0].name == again.name == "h_float16_1"


def test_names_are_unique_across_values_and_nodes_separately():
    model = relu_model()
    names = UniqueNames(model)
    assert names.value("h") == "h_1" and names.value("h") == "h_2" and names.value("fresh") == "fresh"
    assert names.node("relu") == "relu_1" and names.node("h") == "h"   # node and value names are apart


def test_a_graph_output_cast_keeps_the_models_output_name():
    model = relu_model()
    cast = cast_graph_output(model.graph, 0, D.FLOAT16, UniqueNames(model))
    assert model.graph.outputs[0] is cast.outputs[0] and model.graph.outputs[0].name == "y"
    assert model.graph.node("neg").outputs[0].name == "y_float32"
    assert model.graph.outputs[0].dtype == D.FLOAT16
    check(model)


def test_an_output_that_is_a_graph_input_is_cast_at_the_end():
    model = ir_model([], [tensor_input("x", F32, [2])], [tensor_input("x", F32, [2])])
    cast = cast_graph_output(model.graph, 0, D.FLOAT16, UniqueNames(model))
    assert model.graph.inputs[0].name == "x" and model.graph.outputs[0] is cast.outputs[0]
    assert cast.outputs[0].name == "x_float16"


def test_bypassing_a_cast_hands_its_readers_to_its_source():
    model = relu_model()
    h = model.graph.node("relu").outputs[0]
    cast = make_cast(h, D.FLOAT16, UniqueNames(model))
    model.graph.node("neg").replace_input_with(0, cast.outputs[0])
    assert bypass_cast(cast)
    assert order(model) == ["relu", "neg"] and model.graph.node("neg").inputs[0] is h


def test_bypassing_an_output_cast_gives_the_output_name_to_the_source():
    model = relu_model()
    cast = cast_graph_output(model.graph, 0, D.FLOAT16, UniqueNames(model))
    assert bypass_cast(cast)
    assert model.graph.outputs[0].name == "y" and model.graph.outputs[0].producer().name == "neg"
    check(model)


def test_an_output_cast_of_a_graph_input_cannot_be_bypassed():
    model = ir_model([helper.make_node("Cast", ["x"], ["y"], to=F16, name="cast")],
                     [tensor_input("x", F32, [2])], [tensor_input("y", F16, [2])])
    assert not bypass_cast(model.graph.node("cast"))
    assert order(model) == ["cast"] and model.graph.outputs[0].name == "y"


def test_a_node_runs_fp32_between_casts_sharing_one_cast_per_value():
    model = ir_model([helper.make_node("Mul", ["x", "x"], ["m"], name="mul"),
                      helper.make_node("Softmax", ["m"], ["s"], name="softmax"),
                      helper.make_node("Neg", ["s"], ["y"], name="neg")],
                     [tensor_input("x", F16, [2, 3])], [tensor_input("y", F16, [2, 3]), tensor_input("s", F16, [2, 3])])
    softmax = model.graph.node("softmax")
    run_fp32_between_casts(model.graph.node("mul"), D.FLOAT16, UniqueNames(model))
    mul = model.graph.node("mul")
    assert mul.inputs[0] is mul.inputs[1] and mul.inputs[0].producer().name == "x_float32"   # one Cast for both
    assert mul.outputs[0].dtype == D.FLOAT and softmax.inputs[0].name == "m_float16"
    run_fp32_between_casts(softmax, D.FLOAT16, UniqueNames(model))   # its output is a graph output too
    assert model.graph.outputs[1].name == "s" and model.graph.outputs[1].dtype == D.FLOAT16
    assert model.graph.node("neg").inputs[0].dtype == D.FLOAT16
    check(model)
    import onnxruntime as ort
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    x = np.linspace(-3, 3, 6, dtype=np.float16).reshape(2, 3)
    y, s = session.run(None, {"x": x})
    square = x.astype(np.float32) ** 2   # computed fp32 from the fp16 input
    expected = (np.exp(square) / np.exp(square).sum(-1, keepdims=True)).astype(np.float16)
    assert s.dtype == np.float16 and np.array_equal(y, -s) and np.allclose(s, expected, atol=1e-3)


def test_the_low_dtype_of_a_nodes_data_inputs():
    model = ir_model([helper.make_node("Add", ["a", "b"], ["c"], name="mixed"),
                      helper.make_node("Add", ["a", "a"], ["d"], name="low"),
                      helper.make_node("LayerNormalization", ["a", "scale"], ["e"], name="norm")],
                     [tensor_input("a", F16, [2]), tensor_input("b", F32, [2])],
                     [tensor_input("c", F32, [2]), tensor_input("d", F16, [2]), tensor_input("e", F16, [2])],
                     [initializer("scale", np.ones(2, np.float16))])
    assert low_data_dtype(model.graph.node("low"), only_low=True) == D.FLOAT16
    assert low_data_dtype(model.graph.node("mixed"), only_low=False) == D.FLOAT16
    assert low_data_dtype(model.graph.node("mixed"), only_low=True) is None   # an fp32 input beside it
    relu = relu_model().graph.node("relu")
    assert low_data_dtype(relu, only_low=False) is None   # fp32 only
