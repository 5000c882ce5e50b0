"""The ONNX conversion report reads as explain()'s: summary (nodes, casts, weights, calibration, fp32 islands
with their rule), the table by module on request, to_dict()/JSON, _repr_html_; export_onnx's progress bar."""
import json

import numpy as np
import pytest
import torch
from onnx import helper
from torch import nn

from amp_compiler import convert_onnx, export_onnx
from amp_compiler.onnx import progress
from amp_compiler.onnx.export import EXPORT_PIPELINE, export_fp32_reference
from onnx_testing import F32, initializer, make_model, save, tensor_input
from test_onnx_validate import overflowing_model           # x @ 100: 120000 for x = 300


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.proj(x), -1)


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def two_blocks(tmp_path_factory):
    """convert_onnx's report on the fp32 export of TwoBlocks (name scopes give the module paths)."""
    src = str(tmp_path_factory.mktemp("onnx_report") / "two_blocks.onnx")
    export_fp32_reference(TwoBlocks().eval(), (torch.randn(2, 8),), src)
    return convert_onnx(src, None)


def softmax_chain():
    """gemm -> softmax -> add -> gemm: one fp32 island of two nodes (softmax seeds it, add follows)."""
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="first_gemm"),
             helper.make_node("Softmax", ["h"], ["s"], name="softmax"),
             helper.make_node("Add", ["s", "x"], ["a"], name="add_input"),
             helper.make_node("Gemm", ["a", "w", "b"], ["y"], name="second_gemm")]
    rng = np.random.default_rng(0)
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])],
                      [initializer("w", rng.standard_normal((4, 4)).astype(np.float32)),
                       initializer("b", rng.standard_normal(4).astype(np.float32))])


def test_summary_counts_nodes_casts_and_names_the_fp32_island_and_its_rule(tmp_path):
    report = convert_onnx(save(softmax_chain(), tmp_path, "src.onnx"), None)
    lines = str(report).splitlines()
    assert lines[0].startswith("amp-compiler onnx: ") and "level O1, float16" in lines[0]
    assert lines[1].startswith(f"nodes: 2 float16, 2 float32, 0 untouched; casts: {report.casts} (source had 0)")
    assert report.casts == sum(r["op"] == "cast" for r in report.rows) > 0
    assert report.islands == [{"nodes": ["softmax", "add_input"], "ops": ["softmax", "add"], "module": "",
                               "seed": "softmax", "rule": report.islands[0]["rule"]}]
    assert report.islands[0]["rule"].startswith("deny: exp")
    assert "fp32 islands: 1, 2 nodes (runs of connected nodes kept float32)" in lines
    assert any(line.startswith("  (top level): 2 nodes (softmax, add); softmax: deny: exp") for line in lines)


def test_calibration_says_which_nodes_the_ranges_kept_fp32(tmp_path):
    src = save(overflowing_model(), tmp_path, "fp32.onnx")
    data = [(np.full((1, 4), 300.0 * scale, np.float32),) for scale in (0.1, 1.0, 1.2)]
    calibrated, plain = convert_onnx(src, None, calibration_data=data), convert_onnx(src, None)
    assert "range calibration (3 samples): 3 nodes kept fp32: first_matmul, relu, second_matmul" in \
        calibrated.summary_lines()
    assert not any("range calibration" in line for line in plain.summary_lines())
    assert calibrated.islands[0]["nodes"] == ["first_matmul", "relu", "second_matmul"]
    assert calibrated.islands[0]["rule"].startswith("range: max |x| = 1.4e5 > 65504 on 2 of 3 samples")


@pytest.mark.slow
def test_table_by_module_groups_rows_and_folds_the_repeated_block(two_blocks):
    plain, grouped = two_blocks.table().splitlines(), two_blocks.table(by_module=True).splitlines()
    assert len(plain) == len(two_blocks.rows)                  # one line per node, as before
    assert "layers.0" in grouped and "head" in grouped
    assert "layers.1: same decisions as layers.0 (4 rows)" in grouped
    assert not any(line.startswith("  node_softmax_1 ") for line in grouped)   # folded away
    assert any(line.startswith("  layers.[0-1] (x2): 1 node (softmax); softmax: deny:") for line in
               two_blocks.summary_lines())


def test_to_dict_is_json_with_the_rows_islands_and_counts(two_blocks):
    data = json.loads(two_blocks.to_json())
    assert data == two_blocks.to_dict()
    assert [r["node"] for r in data["rows"]] == [r["node"] for r in two_blocks.rows]
    assert data["islands"] == two_blocks.islands and len(data["islands"]) == 2
    assert data["nodes_per_precision"] == two_blocks.nodes_per_precision == {"float16": 3, "float32": 2}
    assert data["casts"] == two_blocks.casts and "model" not in data


def test_html_has_the_summary_and_one_coloured_row_per_node(two_blocks):
    from amp_compiler.insight.report_html import PRECISION_COLOURS
    html = two_blocks._repr_html_()
    assert "fp32 islands: 2, 2 nodes" in html
    assert html.count("<tr style=") == len(two_blocks.rows)
    kinds = {"cast": sum(r["op"] == "cast" for r in two_blocks.rows), "fp32": 2, "low": 3}
    for kind, rows in kinds.items():
        assert html.count(f"background:{PRECISION_COLOURS[kind]}") == rows


@pytest.mark.slow
def test_export_onnx_report_has_islands_and_module_groups(tmp_path):
    report = export_onnx(TwoBlocks().eval(), (torch.randn(2, 8),), tmp_path / "fp16.onnx", progress=False)
    assert [island["nodes"] for island in report.islands] == [["softmax"], ["softmax_1"]]
    assert "fp32 islands: 2, 2 nodes (runs of connected nodes kept float32)" in report.summary_lines()
    assert {"layers.0", "layers.1", "head"} <= set(report.table(by_module=True).splitlines())


@pytest.mark.slow
def test_export_onnx_progress_steps_through_export_passes_and_save(tmp_path, monkeypatch, capsys):
    export_onnx(TwoBlocks().eval(), (torch.randn(2, 8),), tmp_path / "quiet.onnx")   # quick, not a terminal
    assert "export_onnx" not in capsys.readouterr().err
    steps = []
    real = progress.ConversionProgress.advance
    monkeypatch.setattr(progress.ConversionProgress, "advance",
                        lambda self, name: steps.append(name) or real(self, name))
    export_onnx(TwoBlocks().eval(), (torch.randn(2, 8),), tmp_path / "shown.onnx", progress=True)
    assert "export_onnx" in capsys.readouterr().err
    skipped = ("lower_fp8_matmuls", "lower_graph_inputs", "declare_initializer_inputs",   # O1 (not fp8), keep_io_types,
               "infer_types:verify")                                                 # IR 10, export
    ran = [p.name for p in EXPORT_PIPELINE.passes if p.name not in skipped]
    assert steps == ["capture", "convert", "torch.onnx.export", *ran, "save"]
