"""onnx/widen_denied_ops.py: an exported node that runs low and whose canonical op the rules deny (the Softmax
torch.onnx writes out of an fp16 sdpa) runs fp32 between Casts, unless convert() painted that family low, a
force_low pattern names its torch node, or the rules do not deny it."""
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper

from amp_compiler.passes.onnx.widen_denied_ops import widen_denied_onnx_ops
from amp_compiler.passes.policy.rules import PrecisionRules
from onnx_testing import F16, F32, make_model, tensor_input

D = ir.DataType
RULES = PrecisionRules.build("O1", "float16")


def attention(dtype=F16) -> ir.Model:
    """MatMul -> Softmax -> MatMul in one dtype, the Softmax carrying the metadata torch.onnx writes."""
    nodes = [helper.make_node("MatMul", ["q", "k"], ["scores"], name="node_matmul"),
             helper.make_node("Softmax", ["scores"], ["probs"], name="node_softmax"),
             helper.make_node("MatMul", ["probs", "v"], ["y"], name="node_matmul_1")]
    proto = make_model(nodes, [tensor_input(n, dtype, [2, 4, 4]) for n in ("q", "k", "v")],
                       [tensor_input("y", dtype, [2, 4, 4])])
    proto.graph.node[1].metadata_props.add(key="pkg.torch.onnx.fx_node",
                                           value="%softmax_3 : [num_users=1] = call_function[...](args = (%mm,))")
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def signature(model) -> list:
    return [(n.op_type, [v.name for v in n.inputs], [(v.name, v.dtype) for v in n.outputs]) for n in model.graph]


def run(model, feeds):
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_an_fp16_softmax_runs_fp32_between_casts():
    model = attention()
    result = widen_denied_onnx_ops(model, RULES)
    assert result.modified and result.counts == {"denied_nodes_widened": 1}
    assert [n.op_type for n in model.graph] == ["MatMul", "Cast", "Softmax", "Cast", "MatMul"]
    softmax = model.graph.node("node_softmax")
    assert softmax.inputs[0].dtype == D.FLOAT and softmax.outputs[0].dtype == D.FLOAT
    assert model.graph.node("node_matmul_1").inputs[0].dtype == D.FLOAT16   # the matmuls stay fp16
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    feeds = {n: np.random.default_rng(i).standard_normal((2, 4, 4)).astype(np.float16) for i, n in enumerate("qkv")}
    scores = feeds["q"].astype(np.float32) @ feeds["k"].astype(np.float32)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (probs / probs.sum(-1, keepdims=True)) @ feeds["v"].astype(np.float32)
    assert np.allclose(run(model, feeds), expected, atol=2e-2)


def test_nothing_changes_where_convert_painted_the_family_low_or_the_user_forced_the_node_low():
    for rules, families in ((RULES, frozenset({"softmax"})),
                            (PrecisionRules.build("O1", "float16", force_low=["softmax_3"]), frozenset())):
        model = attention()
        before = signature(model)
        assert widen_denied_onnx_ops(model, rules, families).counts == {"denied_nodes_widened": 0}
        assert signature(model) == before


def test_an_fp32_model_and_a_level_that_runs_softmax_low_are_left_alone():
    model = attention(F32)
    before = signature(model)
    assert not widen_denied_onnx_ops(model, RULES).modified and signature(model) == before
    model = attention()
    before = signature(model)
    assert not widen_denied_onnx_ops(model, PrecisionRules.build("O3", "float16")).modified
    assert signature(model) == before
