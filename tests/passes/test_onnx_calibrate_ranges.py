"""onnx/calibrate_ranges.py: record_onnx_ranges runs the fp32 model in ONNX Runtime with every float value
exposed and writes each node's figures (the record fx's calibration writes); the model is not changed."""
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import helper

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.onnx.calibrate_ranges import record_onnx_ranges
from onnx_testing import F32, initializer, make_model, tensor_input


def scaled() -> ir.Model:
    """x * 1e5 (past fp16's 65504 where |x| > 0.65504), / 1e5, then * 1e-6 (below fp16's normal range)."""
    nodes = [helper.make_node("Mul", ["x", "big"], ["m"], name="mul"),
             helper.make_node("Div", ["m", "big"], ["d"], name="div"),
             helper.make_node("Mul", ["d", "tiny"], ["y"], name="mul_tiny")]
    proto = make_model(nodes, [tensor_input("x", F32, [2, 3])], [tensor_input("y", F32, [2, 3])],
                       [initializer("big", np.array(1e5, np.float32)), initializer("tiny", np.array(1e-6, np.float32))])
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))


def ranges(model) -> dict:
    return {n.name: facts(n).get("range") for n in model.graph}


def test_each_node_gets_its_figures_over_the_samples():
    model = scaled()
    samples = [(np.full((2, 3), 2.0, np.float32),), (torch.full((2, 3), 0.1),), np.full((2, 3), 3.0, np.float32)]
    result = record_onnx_ranges(model, samples, torch.float16)
    r = ranges(model)
    assert r["mul"] == {"samples": 3, "max_abs": pytest.approx(3e5), "overflows": 2, "read_max": 0.0,
                        "read_from": None, "below_normal": 0.0}   # x is a graph input: no node produced it
    assert r["div"]["overflows"] == 2 and r["div"]["read_from"] == "mul" and r["div"]["max_abs"] == pytest.approx(3.0)
    assert r["mul_tiny"]["overflows"] == 0 and r["mul_tiny"]["below_normal"] == 1.0
    assert result.counts == {"samples": 3, "nodes_overflowing": 2} and not result.modified


def test_the_model_is_left_as_it_was():
    model = scaled()
    before = ir.serde.serialize_model(model).SerializeToString()
    record_onnx_ranges(model, [(np.ones((2, 3), np.float32),)], torch.float16)
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_in_bf16_nothing_overflows():
    model = scaled()
    record_onnx_ranges(model, [(np.full((2, 3), 3.0, np.float32),)], torch.bfloat16)
    assert all(r["overflows"] == 0 and r["below_normal"] == 0.0 for r in ranges(model).values())


def test_a_sample_ort_refuses_names_its_index_and_shapes():
    with pytest.raises(ValueError, match=r"calibration_data sample 1 \(x: float32\[2, 4\]\) fails in ONNX Runtime"):
        record_onnx_ranges(scaled(), [(np.ones((2, 3), np.float32),), (np.ones((2, 4), np.float32),)], torch.float16)
    with pytest.raises(ValueError, match="sample 0 has 2 input"):
        record_onnx_ranges(scaled(), [(np.ones((2, 3), np.float32),) * 2], torch.float16)
