"""onnx/declare_initializer_inputs.py: below IR 4 every initializer is declared a graph input (subgraphs too),
which onnx.checker requires there; from IR 4 on a model is left as it is."""
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from amp_compiler.passes.onnx.declare_initializer_inputs import declare_initializer_inputs
from onnx_testing import F32, initializer, make_model, tensor_input


def model(ir_version: int, with_branch=False) -> ir.Model:
    nodes = [helper.make_node("Add", ["x", "w"], ["h"], name="add"), helper.make_node("Add", ["h", "b"], ["y"], name="add_b")]
    outputs = [tensor_input("y", F32, [2])]
    if with_branch:
        branch = helper.make_graph([helper.make_node("Mul", ["y", "k"], ["z"], name="mul")], "then", [],
                                   [tensor_input("z", F32, [2])], initializer=[initializer("k", np.full(2, 3.0, np.float32))])
        nodes += [helper.make_node("Identity", ["c"], ["cond"], name="id"),
                  helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch, name="if")]
        outputs.append(tensor_input("out", F32, [2]))
    proto = make_model(nodes, [tensor_input("x", F32, [2]), tensor_input("w", F32, [2]),
                               *([tensor_input("c", onnx.TensorProto.BOOL, [])] if with_branch else [])],
                       outputs, [initializer("w", np.ones(2, np.float32)), initializer("b", np.zeros(2, np.float32))],
                       opset=8 if ir_version < 4 else 18)
    proto.ir_version = ir_version
    return ir.from_proto(proto)


def input_names(graph) -> list[str]:
    return [v.name for v in graph.inputs]


def test_below_ir_4_an_initializer_without_an_input_is_declared_one():
    m = model(3)
    assert input_names(m.graph) == ["x", "w"]
    result = declare_initializer_inputs(m)
    assert result.modified and result.counts == {"initializers_declared_as_inputs": 1}
    assert input_names(m.graph) == ["x", "w", "b"]
    assert m.graph.inputs[2] is m.graph.initializers["b"]   # the same value: the initializer is its default
    onnx.checker.check_model(ir.serde.serialize_model(m))
    assert declare_initializer_inputs(m).counts == {"initializers_declared_as_inputs": 0}   # once only


def test_subgraph_initializers_are_declared_in_their_own_graph():
    m = model(3, with_branch=True)
    assert declare_initializer_inputs(m).counts == {"initializers_declared_as_inputs": 3}   # b; k in each branch
    branch = m.graph.node("if").attributes["then_branch"].as_graph()
    assert input_names(branch) == ["k"]


def test_from_ir_4_on_nothing_changes():
    m = model(4)
    result = declare_initializer_inputs(m)
    assert not result.modified and result.counts == {}
    assert input_names(m.graph) == ["x", "w"]
