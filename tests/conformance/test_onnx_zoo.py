"""Every zoo model at O1/O2/O3 through both entry points: export_onnx (the graph convert() builds) and
convert_onnx (an fp32 ONNX export converted with the same rules). Each model is exported once per level
(torch.onnx with dynamo is the slow part) and shared by the tests through a module-scoped fixture."""
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from amp_compiler import convert_onnx, export_onnx
from amp_compiler.onnx.export import export_fp32_reference
from models import ZOO_NAMES, build
from onnx_testing import F16, F32, all_nodes, assert_valid, run, same_model, value_types

pytestmark = pytest.mark.slow  # the zoo exported and run in ONNX Runtime: 25 s

LEVELS = ("O1", "O2", "O3")
WEIGHT_READERS = {"MatMul": 1, "Gemm": 1, "Conv": 1}     # op type -> index of its weight input
FP32_AT_O1 = ("LayerNormalization", "Softmax", "ReduceSum", "Exp", "Pow")   # ReduceMean: an average runs low


@pytest.fixture(scope="module", params=ZOO_NAMES)
def zoo(request, tmp_path_factory):
    name, directory = request.param, tmp_path_factory.mktemp(request.param)
    task = build(name, size="small")
    task.model.eval()
    fp32 = str(directory / "fp32.onnx")
    export_fp32_reference(task.model, task.example_inputs, fp32)
    with torch.no_grad():
        reference = task.model(*task.example_inputs).numpy()
    outputs = {}
    for level in LEVELS:
        exported, converted = str(directory / f"export_{level}.onnx"), str(directory / f"convert_{level}.onnx")
        outputs["export", level] = exported, export_onnx(task.model, task.example_inputs, exported, level)
        outputs["convert", level] = converted, convert_onnx(fp32, converted, level)
    feeds = {i.name: x.numpy() for i, x in zip(onnx.load(fp32).graph.input, task.example_inputs)}
    return SimpleNamespace(name=name, directory=directory, fp32=fp32, reference=reference, feeds=feeds,
                           outputs=outputs)


@pytest.mark.parametrize("entry", ["export", "convert"])
@pytest.mark.parametrize("level", LEVELS)
def test_output_is_valid_and_matches_fp32(zoo, level, entry):
    path, report = zoo.outputs[entry, level]
    assert_valid(path)   # checker full_check, no Cast chains / duplicates / casts of weights, sorted, named
    (output,) = run(path, zoo.feeds)
    assert output.dtype == np.float32                                   # keep_io_types
    scale = max(float(np.abs(zoo.reference).max()), 1e-3)
    assert np.abs(output - zoo.reference).max() <= 1e-2 * scale
    assert report.level == level and report.dtype == "float16"


@pytest.mark.parametrize("entry", ["export", "convert"])
@pytest.mark.parametrize("level", LEVELS)
def test_weights_are_stored_in_fp16(zoo, level, entry):
    path, report = zoo.outputs[entry, level]
    model = onnx.load(path)
    stored = {t.name: t.data_type for t in model.graph.initializer}
    weights = [n.input[WEIGHT_READERS[n.op_type]] for n in model.graph.node if n.op_type in WEIGHT_READERS]
    assert weights and all(stored[w] == F16 for w in weights if w in stored)
    float_bytes = sum(t.ByteSize() for t in model.graph.initializer if t.data_type in (F16, F32))
    fp16_bytes = sum(t.ByteSize() for t in model.graph.initializer if t.data_type == F16)
    if level == "O3" and entry == "convert":   # (convert() keeps embedding tables fp32: a lookup casts nothing)
        assert fp16_bytes >= 0.9 * float_bytes
    assert report.weight_bytes_after < report.weight_bytes_before


@pytest.mark.parametrize("level", LEVELS)
def test_converted_embedding_tables_are_stored_in_fp16(zoo, level):
    """Also at O1, where the lookup feeds an fp32 LayerNorm: the Gather runs low, its rows are cast up."""
    model = onnx.load(zoo.outputs["convert", level][0])
    stored = {t.name: t.data_type for t in model.graph.initializer}
    tables = [n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in stored]
    assert bool(tables) == (zoo.name in ("bert", "gpt"))
    assert all(stored[t] == F16 for t in tables)


@pytest.mark.parametrize("entry", ["export", "convert"])
def test_o1_keeps_norms_softmax_and_reductions_fp32(zoo, entry):
    path, _ = zoo.outputs[entry, "O1"]
    model = onnx.load(path)
    types = value_types(model)
    fragile = [n for n in all_nodes(model) if n.op_type in FP32_AT_O1]
    assert all(types[n.input[0]] == F32 for n in fragile), [n.name for n in fragile if types[n.input[0]] != F32]
    assert all(types[n.input[0]] == F16 for n in all_nodes(model) if n.op_type in WEIGHT_READERS)


def test_both_entry_points_make_the_same_o1_decisions(zoo):
    """One rule set: the ops both graphs contain read the same dtype in both files."""
    seen = {entry: _input_dtypes_by_op(zoo.outputs[entry, "O1"][0]) for entry in ("export", "convert")}
    shared = (set(seen["export"]) & set(seen["convert"])) & {*WEIGHT_READERS, "LayerNormalization", "Softmax"}
    assert shared
    assert {op: seen["export"][op] for op in shared} == {op: seen["convert"][op] for op in shared}


@pytest.mark.parametrize("level", LEVELS)
def test_converting_a_converted_model_changes_nothing(zoo, level):
    for entry in ("convert", "export"):
        path, _ = zoo.outputs[entry, level]
        if entry == "export":   # an exported model converted at its level: same casts afterwards, then stable
            path = str(zoo.directory / f"export_{level}_converted.onnx")
            convert_onnx(zoo.outputs["export", level][0], path, level)
        again = str(zoo.directory / f"{entry}_{level}_again.onnx")
        convert_onnx(path, again, level)
        assert same_model(path, again)


def _input_dtypes_by_op(path: str) -> dict[str, set]:
    model = onnx.load(path)
    types = value_types(model)
    found = defaultdict(set)
    for node in all_nodes(model):
        found[node.op_type].add(types.get(node.input[0]))
    return dict(found)
