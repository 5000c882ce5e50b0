"""onnx/hand_written_norms.py: the ONNX side of keep_norms_fp32 on an RMSNorm as torch.onnx writes it (Pow,
ReduceMean, Add eps, Sqrt -> Reciprocal, Mul), constants left out of a node's inputs: at O2 its nodes run
fp32, the weight's Mul stays low; at O3 the painting is left as it was."""
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.hand_written_norms import keep_onnx_hand_written_norms_fp32
from amp_compiler.passes.policy.rules import PrecisionRules
from onnx_testing import F32, initializer, make_model, tensor_input

NORM = ["pow", "mean", "add", "sqrt", "reciprocal", "mul"]


def rms_norm(second_moment_read_by="mul", inverse="Reciprocal") -> ir.Model:
    two, one = helper.make_tensor("two", F32, [], [2.0]), helper.make_tensor("one", F32, [], [1.0])
    nodes = [helper.make_node("MatMul", ["x", "w_in"], ["h"], name="proj"),
             helper.make_node("Constant", [], ["exponent"], value=two, name="const"),
             helper.make_node("Pow", ["h", "exponent"], ["sq"], name="pow"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1, name="mean"),
             helper.make_node("Add", ["ms", "eps"], ["var"], name="add"),
             helper.make_node("Sqrt", ["var"], ["root"], name="sqrt"),
             helper.make_node("Reciprocal", ["root"], ["inv"], name="reciprocal"),
             helper.make_node("Mul", ["h", "inv"], ["normed"], name="mul"),
             helper.make_node("Mul", ["weight", "normed"], ["y"], name="mul_weight")]
    if inverse == "Div":   # 1 / root, the 1 a Constant node: not an input of the shape, so a statistic step
        nodes[6:7] = [helper.make_node("Constant", [], ["c_one"], value=one, name="const_one"),
                      helper.make_node("Div", ["c_one", "root"], ["inv"], name="reciprocal")]
    if second_moment_read_by != "mul":   # the 1/root read by a matmul: nothing is normalised
        nodes[-2] = helper.make_node("MatMul", ["inv", "w_out"], ["normed"], name="mul")
    proto = make_model(nodes, [tensor_input("x", F32, [2, 8])], [tensor_input("y", F32, None)],
                       [initializer("w_in", np.ones((8, 8), np.float32)), initializer("axes", np.array([-1])),
                        initializer("eps", np.array(1e-6, np.float32)), initializer("weight", np.ones(8, np.float32)),
                        initializer("w_out", np.ones((1, 8), np.float32))])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    onnx_canonicalize(model)
    return model


def decided(model, level="O2", hook=True) -> dict:
    rules = PrecisionRules.build(level, "float16")
    painted = [keep_onnx_hand_written_norms_fp32(model.graph, rules.norm_kept_fp32())] if hook else []
    decide_onnx_precision(model, rules, ir.DataType.FLOAT16, painted=painted)
    return {n.name: (n.meta["amp"]["precision"], n.meta["amp"]["rule"]) for n in model.graph}


def test_an_rms_norm_written_out_runs_fp32_at_o2():
    f = decided(rms_norm())
    assert {n for n, (p, _) in f.items() if p == "fp32"} == set(NORM)
    assert f["proj"][0] == f["mul_weight"][0] == "low"
    assert f["sqrt"][1].startswith("norm: a hand-written RMSNorm (pow -> mean -> add -> sqrt -> reciprocal -> mul, "
                                   "normalising at mul), kept fp32 as the level keeps norms (")


def test_one_divided_by_a_constant_free_root_is_the_inverse_too():
    f = decided(rms_norm(inverse="Div"))
    assert {n for n, (p, _) in f.items() if p == "fp32"} == set(NORM)
    assert "sqrt -> div -> mul" in f["mean"][1]


def test_without_the_hook_o2_runs_it_low():
    f = decided(rms_norm(), hook=False)
    assert all(f[n][0] == "low" for n in NORM)


def test_a_chain_that_normalises_nothing_and_a_level_that_runs_norms_low_change_nothing():
    assert decided(rms_norm("matmul")) == decided(rms_norm("matmul"), hook=False)
    assert decided(rms_norm(), "O3") == decided(rms_norm(), "O3", hook=False)
