"""A user's mistake gets one clear error naming the argument, the input, the module or the op (issue 17):
example inputs that do not fit the model, op-name typos, calibration_data that is not a list of input
tuples, compare() on inputs the model refuses; and a float64 model converted without example inputs is
reported as what runs (fp64, never cast)."""
import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import compare, convert, explain, verify
from amp_compiler.passes.fx.runtime import is_cast


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mlp_with_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()


def short(error) -> str:
    message = str(error.value)
    assert len(message.splitlines()) <= 3, message
    return message


class TestExampleInputs:
    def test_integer_input_for_a_linear_names_the_input_and_the_module(self):
        model = mlp()
        with pytest.raises(ValueError) as error:
            convert(model, example_inputs=(torch.arange(8).view(2, 4),))
        message = short(error)
        assert "example input 0" in message and "int64" in message and "'0'" in message and "linear" in message

    def test_a_wrong_count_of_inputs_is_a_type_error_with_both_counts(self):
        with pytest.raises(TypeError) as error:
            convert(mlp(), example_inputs=(torch.randn(2, 4), torch.randn(2, 4)))
        message = short(error)
        assert "example_inputs" in message and "1" in message and "2" in message

    def test_a_shape_the_first_layer_refuses_names_the_node_and_the_input_shapes(self):
        with pytest.raises(ValueError) as error:
            convert(mlp(), example_inputs=(torch.randn(2, 5),))
        message = short(error)
        assert "example_inputs" in message and "'0'" in message and "[2, 5]" in message

    def test_nodes_that_need_real_data_still_convert(self):
        class Gather(nn.Module):   # nonzero: a data-dependent shape fake values cannot give
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x)[torch.nonzero(x[:, 0] > 0).squeeze(1)]

        model = Gather()
        x = torch.randn(6, 4)
        gm = convert(model, example_inputs=(x,))
        torch.testing.assert_close(gm(x), model(x), rtol=1e-2, atol=1e-2)


def test_float64_model_without_example_inputs_is_reported_as_fp64():
    model = mlp().double()
    gm = convert(model)
    assert not [n for n in gm.graph.nodes if is_cast(n)], gm.code
    assert {row["precision"] for row in explain(gm).rows} == {"untouched"}, str(explain(gm))   # fp64: never cast
    x = torch.randn(3, 4, dtype=torch.float64)
    verify(gm, x)                                    # the recorded dtypes are the ones that run
    assert torch.equal(gm(x), model(x))


class TestOpNames:
    def test_a_typo_is_rejected_with_the_nearest_names(self):
        with pytest.raises(ValueError) as error:
            convert(mlp(), deny_ops=["softmx"])
        message = short(error)
        assert "deny_ops" in message and "'softmx'" in message and "softmax" in message
        assert "custom_ops" in message

    def test_an_op_of_the_graph_or_a_declared_custom_op_is_accepted(self):
        class Custom(nn.Module):
            def forward(self, x):
                return torch.special.erfcx(x)

        gm = convert(Custom(), infer_ops=["special_erfcx"])   # unknown to the table, but in this graph
        assert {n.meta["amp"].get("class") for n in gm.graph.nodes if n.op == "call_function"} == {"infer"}
        convert(mlp(), deny_ops=["my_fused_op"], custom_ops=["my_fused_op"])

    def test_an_alias_acts_on_its_canonical_op(self):
        class Halve(nn.Module):
            def forward(self, x):
                return (torch.relu(x @ x) / 2) @ x

        def div_precision(**rules):
            gm = convert(Halve(), cast_placement=False, **rules)
            return next(n.meta["amp"]["precision"] for n in gm.graph.nodes if n.meta["amp"].get("op") == "div")

        assert div_precision() == "low"
        assert div_precision(deny_ops=["truediv"]) == "fp32"


class TestCalibrationData:
    def test_a_bare_tensor_is_a_type_error(self):
        with pytest.raises(TypeError) as error:
            convert(mlp_with_norm(), calibration_data=torch.randn(5, 4))
        message = short(error)
        assert "calibration_data" in message and "[5, 4]" in message

    def test_a_sample_with_the_wrong_arity_names_its_index(self):
        samples = [(torch.randn(5, 4),), (torch.randn(5, 4), torch.randn(5, 4))]
        with pytest.raises(ValueError) as error:
            convert(mlp_with_norm(), calibration_data=samples)
        message = short(error)
        assert "calibration_data" in message and "sample 1" in message

    def test_a_sample_the_model_refuses_names_its_index(self):
        samples = [(torch.randn(5, 4),), (torch.randn(5, 3),)]
        with pytest.raises(ValueError) as error:
            convert(mlp_with_norm(), calibration_data=samples)
        message = short(error)
        assert "calibration_data" in message and "sample 1" in message

    def test_onnx_rejects_a_bare_tensor_too(self, tmp_path):
        path = tmp_path / "mlp.onnx"
        torch.onnx.export(mlp(), (torch.randn(2, 4),), str(path), dynamo=False)
        with pytest.raises(TypeError) as error:
            amp_compiler.convert_onnx(str(path), calibration_data=torch.randn(5, 4))
        assert "calibration_data" in short(error)


def test_compare_on_inputs_the_model_refuses_names_them():
    model = mlp()
    gm = convert(model, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ValueError) as error:
        compare(model, gm, (torch.randn(2, 5),))
    message = short(error)
    assert "compare()" in message and "model itself fails" in message and "[2, 5]" in message


def test_verify_with_the_inputs_in_one_tuple_says_how_to_pass_them():
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    amp_compiler.verify(gm, x)
    with pytest.raises(ValueError, match=r"verify\(\): the converted graph fails on these inputs \(tuple\).*"
                                         r"verify\(gm, \*inputs\)"):
        amp_compiler.verify(gm, (x,))
