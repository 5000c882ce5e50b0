"""onnx/torch_origin.py: the ATen op and the torch.export node an exported node came from, read from the
metadata torch.onnx writes (as torch.onnx.export(dynamo=True) writes it for a Linear and a softmax)."""
import onnx_ir as ir
import pytest

from amp_compiler.passes.onnx.torch_origin import origin_node_name, origin_op
from amp_compiler.passes.policy.op_policy import POLICY


def exported(name="node_softmax", **metadata) -> ir.Node:
    node = ir.Node("", "Softmax", [ir.Value(name="x")], name=name)
    node.metadata_props.update(metadata)
    return node


SOFTMAX = {"pkg.torch.onnx.class_hierarchy": "['__main__.M', 'aten.softmax.int']",
           "pkg.torch.onnx.name_scopes": "['', 'softmax']",
           "pkg.torch.onnx.fx_node": "%softmax_1 : [num_users=1] = call_function[target=torch.ops.aten.softmax.int]"
                                     "(args = (%linear, -1), kwargs = {})"}


def test_the_aten_op_is_the_last_class_of_the_hierarchy_named_canonically():
    assert origin_op(exported(**SOFTMAX)) == "softmax"
    sdpa = "['__main__.M', 'GPT2Attention', 'aten.scaled_dot_product_attention.default']"
    assert origin_op(exported(**{"pkg.torch.onnx.class_hierarchy": sdpa})) == "scaled_dot_product_attention"
    private = "['__main__.M', 'aten._native_batch_norm_legit_no_training.default']"
    assert origin_op(exported(**{"pkg.torch.onnx.class_hierarchy": private})) == "batch_norm"   # _ and alias


def test_no_aten_op_when_the_file_does_not_say():
    assert origin_op(exported()) is None
    module_only = "['__main__.M', 'torch.nn.modules.linear.Linear']"
    assert origin_op(exported(**{"pkg.torch.onnx.class_hierarchy": module_only})) is None


@pytest.mark.parametrize("aten, canonical", [("__and__", "and_"), ("__or__", "or_"), ("_softmax", "softmax"),
                                              ("add_", "add"), ("fft_rfft", "rfft")])
def test_an_aten_op_is_named_as_the_fx_canonicalizer_names_it(aten, canonical):
    hierarchy = f"['__main__.M', 'aten.{aten}.Tensor']"
    assert origin_op(exported(**{"pkg.torch.onnx.class_hierarchy": hierarchy})) == canonical
    assert canonical in POLICY   # the name the policy table keys its rule by


def test_the_torch_node_name_is_read_from_the_fx_node_line():
    assert origin_node_name(exported(**SOFTMAX)) == "softmax_1"


def test_without_it_the_onnx_nodes_own_name_stands_in():
    assert origin_node_name(exported("node_softmax")) == "node_softmax"
    assert origin_node_name(exported(None)) == ""
    assert origin_node_name(exported(**{"pkg.torch.onnx.fx_node": "not an fx node line"})) == "node_softmax"
