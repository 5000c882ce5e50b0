"""ONNX op types map onto the canonical ops of the one policy table (no op list of its own)."""
import onnx_ir as ir
import pytest

from amp_compiler.passes.onnx.canonicalize import ONNX_OPS, RANKED, canonical_onnx_op, module_path
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.policy.rules import PrecisionRules


def node(op_type, *, domain="", attributes=(), inputs=()):
    return ir.Node(domain, op_type, list(inputs), list(attributes))


def test_every_mapped_name_is_a_policy_op():
    assert sorted(op for op in ONNX_OPS.values() if op not in POLICY) == []


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_ranked_ops_take_their_spatial_rank(rank):
    for op_type, base in RANKED.items():
        kernel = ir.AttrInt64s("kernel_shape", [3] * rank)
        assert canonical_onnx_op(node(op_type, attributes=[kernel])) == f"{base}{rank}d"
        assert f"{base}{rank}d" in POLICY


def test_conv_rank_comes_from_the_weight_when_there_is_no_kernel_shape():
    weight = ir.Value(name="w", shape=ir.Shape([8, 3, 3, 3, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    assert canonical_onnx_op(node("Conv", inputs=[ir.Value(name="x"), weight])) == "conv3d"


@pytest.mark.parametrize("op_type, expected", [
    ("MatMul", "matmul"), ("Gemm", "linear"), ("Softmax", "softmax"), ("LayerNormalization", "layer_norm"),
    ("ReduceMean", "mean"), ("ReduceSumSquare", "sum"), ("Pow", "pow"), ("Cast", "to"), ("Resize", "interpolate"),
    ("Shape", "shape"), ("If", "cond"), ("Loop", "while_loop"), ("NonMaxSuppression", "non_max_suppression")])
def test_spellings(op_type, expected):
    assert canonical_onnx_op(node(op_type)) == expected


def test_attributes_pick_the_variant():
    add = ir.AttrString("reduction", "add")
    assert canonical_onnx_op(node("ScatterElements", attributes=[add])) == "scatter_add"
    assert canonical_onnx_op(node("ScatterND")) == "index_put"
    assert canonical_onnx_op(node("Trilu", attributes=[ir.AttrInt64("upper", 0)])) == "tril"


def test_custom_domain_ops_are_unknown_and_kept_fp32():
    op = canonical_onnx_op(node("FusedMatMul", domain="com.microsoft"))
    assert op == "fused_mat_mul"
    klass, family, reason = PrecisionRules.build("O1", "float16").classify(op)
    assert (klass, family) == ("deny", "unknown") and "fused_mat_mul" in reason


def test_module_path_comes_from_the_torch_exporter_scopes():
    exported = node("MatMul")
    exported.metadata_props["pkg.torch.onnx.name_scopes"] = "['layers.0', 'layers.0.attention.query', 'linear']"
    assert module_path(exported) == "layers.0.attention.query"
    assert module_path(node("MatMul")) == ""
    quoted = node("MatMul")   # a module name with a quote: repr switches quote style, the slow parser reads it
    quoted.metadata_props["pkg.torch.onnx.name_scopes"] = """['', "blocks.it's", 'linear']"""
    assert module_path(quoted) == "blocks.it's"
    garbled = node("MatMul")
    garbled.metadata_props["pkg.torch.onnx.name_scopes"] = "['layers.0', 'linear'"
    assert module_path(garbled) == ""
