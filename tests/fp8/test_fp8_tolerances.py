"""compare() and validate_onnx() at fp8: their default tolerance follows what the graph / file computes in.

A graph converted at level "fp8" with matmuls lowered, or an ONNX file with float8 weights or QuantizeLinear to
float8, is judged at FP8_RTOL (e4m3's 3 mantissa bits: measured worst 0.096-0.105 of scale on the zoo, see
compare.py); anything else keeps its dtype's default (fp16 1e-2, bf16 5e-2, ONNX 1e-2). The fp32 reference of an
fp8 graph is fp32 itself (the matmul on its high-precision operands, each fp8 copy as its exact scaled value):
the outputs' error is measured here independently of compare(), and a scale broken on purpose must still fail.
"""
import math

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn
from unittest import mock

import amp_compiler
from amp_compiler import compare, convert
from amp_compiler.insight.compare import DEFAULT_RTOL, FP8_RTOL
from amp_compiler.passes.fx import fp8_runtime
from models import build

E4M3 = torch.float8_e4m3fn


def relative_output_error(model, gm, inputs) -> float:
    """max |gm - model| over max |model| on the outputs, as compare() defines it, computed without compare()."""
    model.eval(), gm.eval()
    with torch.no_grad():
        got, want = gm(*inputs).double(), model(*inputs).double()
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def gpt_task():
    return build("gpt", size="small", seed=0)


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
def test_a_correct_fp8_model_passes_by_default_against_fp32_itself(gpt_task, recipe):
    model, inputs = gpt_task.model, gpt_task.example_inputs
    gm = convert(model, "fp8", example_inputs=inputs, fp8_min_dim=16, fp8_scaling=recipe)
    report = compare(model, gm, inputs)
    assert report.rtol == FP8_RTOL and report.passed and report.first_failure is None
    assert "(fp8 default: 13 matmuls run in float8, 4 kept bfloat16)" in str(report).splitlines()[0]
    # the reference is the fp32 model, not a replay that still rounds to fp8 (that one noted a mismatch)
    assert report.notes == []
    measured = relative_output_error(model, gm, inputs)
    assert report.outputs[0].max_rel == pytest.approx(measured, rel=1e-6)
    assert 0.02 < measured < FP8_RTOL      # fp8 ran (bf16 alone: ~4e-3) and is within the default
    # bf16's default, the one compare() took at fp8 before, calls this correct model diverging
    assert not compare(model, gm, inputs, rtol=DEFAULT_RTOL["bfloat16"]).passed


def test_a_model_converted_in_place_at_fp8_is_judged_as_the_returned_graph(gpt_task):
    """inplace=True: the model's graphs together take the fp8 default, and each graph's fp32 replay takes the scales
    the converted run took (without them: bf16's 0.05 and a replay that re-derives scales from fp32 values)."""
    import copy
    model, inputs = gpt_task.model, gpt_task.example_inputs
    # weight_cache=False: the broken scale below must reach the weights too (cached fp8 copies keep their scales)
    converted = convert(copy.deepcopy(model), "fp8", example_inputs=inputs, fp8_min_dim=16, inplace=True,
                        weight_cache=False)
    report = compare(model, converted, inputs)
    assert report.rtol == FP8_RTOL and report.passed, str(report)
    assert "fp8 default: 13 matmuls run in float8" in str(report).splitlines()[0]
    assert report.outputs[0].max_rel == pytest.approx(relative_output_error(model, converted, inputs), rel=1e-6)
    broken_scale = fp8_runtime.current_scale
    with mock.patch.object(fp8_runtime, "current_scale", lambda *args: broken_scale(*args) * 2):
        assert not compare(model, converted, inputs).passed


def test_an_explicit_rtol_wins_at_fp8(gpt_task):
    gm = convert(gpt_task.model, "fp8", example_inputs=gpt_task.example_inputs, fp8_min_dim=16)
    report = compare(gpt_task.model, gm, gpt_task.example_inputs, rtol=0.01)
    assert report.rtol == 0.01 and report.rtol_from == "" and not report.passed
    assert "of each value's scale: FAILED" in str(report)


def test_a_scale_off_by_two_fails_at_the_fp8_default(gpt_task):
    """Every scale twice the right one: the top binade of each operand saturates at 448."""
    model, inputs = gpt_task.model, gpt_task.example_inputs
    gm = convert(model, "fp8", example_inputs=inputs, fp8_min_dim=16)
    right = fp8_runtime.current_scale
    with mock.patch.object(fp8_runtime, "current_scale", lambda *args: right(*args) * 2):
        report = compare(model, gm, inputs)
    assert report.rtol == FP8_RTOL and not report.passed
    assert report.first_failure.op == "fp8_cast"    # the saturated copy is named first


def test_a_matmul_unscaled_by_the_wrong_power_of_two_fails():
    """The graph edited: the first fp8 matmul divides by twice its x scale, so its output is half."""
    task = build("mlp", size="small", seed=0)
    gm = convert(task.model, "fp8", example_inputs=task.example_inputs, fp8_min_dim=16)
    matmul = next(n for n in gm.graph.nodes if n.target is fp8_runtime.fp8_scaled_linear)
    assert compare(task.model, gm, task.example_inputs).passed
    with gm.graph.inserting_before(matmul):
        doubled = gm.graph.call_function(torch.mul, (matmul.args[4], 2.0))
    matmul.update_arg(4, doubled)
    gm.recompile()
    report = compare(task.model, gm, task.example_inputs)
    assert not report.passed and report.first_failure.node == matmul.name
    assert report.first_failure.max_rel == pytest.approx(0.5, abs=0.05)


def test_fp16_and_bf16_keep_their_defaults_and_fp8_without_a_lowered_matmul_keeps_bf16s(gpt_task):
    model, inputs = gpt_task.model, gpt_task.example_inputs
    fp16 = compare(model, convert(model, "O1", dtype=torch.float16, example_inputs=inputs), inputs)
    assert fp16.rtol == 1e-2 and "(float16 default)" in str(fp16)
    unlowered = convert(model, "fp8", example_inputs=inputs)    # fp8_min_dim 1024: no zoo matmul qualifies
    report = compare(model, unlowered, inputs)
    assert report.rtol == DEFAULT_RTOL["bfloat16"]
    assert "(bfloat16 default, level fp8 lowered no matmul to float8)" in str(report)


def test_a_frozen_fp8_model_is_judged_as_the_unfrozen_one(gpt_task):
    model, inputs = gpt_task.model, gpt_task.example_inputs
    frozen = convert(model, "fp8", example_inputs=inputs, fp8_min_dim=16, freeze=True)
    report = compare(model, frozen, inputs)
    assert report.rtol == FP8_RTOL and report.passed and report.notes == []
    assert report.outputs[0].max_rel == pytest.approx(relative_output_error(model, frozen, inputs), rel=1e-6)


def test_an_fp8_cast_is_measured_against_its_exact_scaled_value():
    """Inputs exact in bf16: the x cast's error is e4m3 rounding alone, at most half its step at the scale."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    x = torch.randn(16, 64).bfloat16().float()
    gm = convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16)
    errors = {e.node: e for e in compare(model, gm, (x,)).errors}
    cast = errors["linear_x_fp8"]
    assert cast.dtype == "float8_e4m3fn" and 0 < cast.ulps <= 0.5   # ulp of e4m3 (3 bits), not of bf16
    assert errors["linear_x_scale"].max_abs == 0                   # the replay takes the graph's own scales


# -- validate_onnx ------------------------------------------------------------------------------------------------

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    task = build("mlp", size="small", seed=0)
    folder = tmp_path_factory.mktemp("fp8_files")
    fp8, fp16 = folder / "mlp_fp8.onnx", folder / "mlp_fp16.onnx"
    amp_compiler.export_onnx(task.model, task.example_inputs, fp8, "fp8", fp8_min_dim=16)
    amp_compiler.export_onnx(task.model, task.example_inputs, fp16, "O1")
    return task, fp8, fp16


def test_an_fp8_file_passes_validate_onnx_by_default(mlp_files):
    from amp_compiler.onnx.validate import validate_onnx
    task, fp8, _ = mlp_files
    report = validate_onnx(fp8, task.model, task.example_inputs)
    assert report.rtol == FP8_RTOL and report.passed
    assert "(fp8 default: 2 float8 weights, 2 QuantizeLinear to float8)" in str(report).splitlines()[0]
    assert report.outputs[0].max_rel > 0.02                    # fp8 ran
    assert not validate_onnx(fp8, task.model, task.example_inputs, rtol=1e-2).passed   # the former default


def test_an_fp16_file_keeps_validate_onnxs_default(mlp_files):
    from amp_compiler.onnx.validate import validate_onnx
    task, _, fp16 = mlp_files
    report = validate_onnx(fp16, task.model, task.example_inputs)
    assert report.rtol == 1e-2 and report.rtol_from == "default" and report.passed


def test_an_fp8_file_with_a_weight_scale_off_by_two_fails(mlp_files, tmp_path):
    from amp_compiler.onnx.validate import validate_onnx
    task, fp8, _ = mlp_files
    model = onnx.load(str(fp8))
    scale = next(t for t in model.graph.initializer if t.name.endswith("_e4m3_scale"))
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 2, scale.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    report = validate_onnx(broken, task.model, task.example_inputs)
    assert report.rtol == FP8_RTOL and not report.passed


def test_a_quantize_to_float8_by_its_zero_point_counts_as_fp8():
    """Opset 19's form: the float8 type named by the zero point, not by output_dtype."""
    import onnx_ir as ir
    from amp_compiler.onnx.validate import default_onnx_rtol
    zero = helper.make_tensor("zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zero"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "zero"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.array(0.5, np.float32), "s"), zero])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    assert default_onnx_rtol(ir.serde.deserialize_model(proto)) == \
        (FP8_RTOL, "fp8 default: 1 float8 weight, 1 QuantizeLinear to float8")
    plain = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", graph.input,
                                                graph.output), opset_imports=[helper.make_opsetid("", 19)])
    assert default_onnx_rtol(ir.serde.deserialize_model(plain)) == (1e-2, "default")


def test_a_weight_only_fp8_file_with_its_float8_weight_in_a_constant_node_counts_as_fp8(tmp_path):
    """DequantizeLinear of a float8 weight a Constant node holds (tools that fold initializers into Constants
    write it so), activations float16, no QuantizeLinear: it computes in float8, but only float8 initializers
    were counted, so the correct file got 1e-2 and failed (output 0.03 of scale)."""
    from amp_compiler.onnx.validate import validate_onnx
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 64)).astype(np.float32)
    scale = 2.0 ** math.ceil(math.log2(np.abs(weight).max() / 448))
    f8 = helper.make_tensor("w8", onnx.TensorProto.FLOAT8E4M3FN, weight.shape, (weight / scale).ravel().tolist())
    x_info = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, 64])]
    y_info = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 64])]
    nodes = [helper.make_node("Constant", [], ["w8"], value=f8),
             helper.make_node("DequantizeLinear", ["w8", "s"], ["w16"]),
             helper.make_node("Cast", ["x"], ["x16"], to=onnx.TensorProto.FLOAT16),
             helper.make_node("MatMul", ["x16", "w16"], ["y16"]),
             helper.make_node("Cast", ["y16"], ["y"], to=onnx.TensorProto.FLOAT)]
    files = {}
    for name, graph in (("fp8", helper.make_graph(nodes, "g", x_info, y_info,
                                                  [numpy_helper.from_array(np.array(scale, np.float16), "s")])),
                        ("fp32", helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", x_info,
                                                   y_info, [numpy_helper.from_array(weight, "w")]))):
        files[name] = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10),
                  str(files[name]))
    report = validate_onnx(files["fp8"], files["fp32"], (torch.randn(8, 64),))
    assert (report.rtol, report.rtol_from) == (FP8_RTOL, "fp8 default: 1 float8 weight") and report.passed
    assert report.outputs[0].max_rel > 0.01   # fp8's error, past the float16 default
