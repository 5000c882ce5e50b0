"""The pass runner: pipelines print, counts are kept per pass, a failing pass is named, checks run between passes."""
import importlib
import traceback
from pathlib import Path

import onnx
import pytest
import torch

import amp_compiler
from amp_compiler.convert import FX_PIPELINE
from amp_compiler.onnx.convert import ONNX_PIPELINE
from amp_compiler.onnx.export import EXPORT_PIPELINE
from amp_compiler.passes.runner import Pass, PassResult, Pipeline, checking_passes, count
from amp_testing import LinearNormNet


def _trace(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def test_each_pipeline_prints_as_a_numbered_list():
    text = str(FX_PIPELINE)
    assert text.splitlines()[0] == "fx pipeline:"
    for name in ("canonicalize", "decide_precision", "insert_casts", "fold_casts", "cast_after_layout_ops"):
        assert name in text
    assert "propagate_values" in text and "only when" in text
    assert str(ONNX_PIPELINE).splitlines()[0] == "onnx pipeline:"
    assert "infer_types:verify" in str(ONNX_PIPELINE) and "widen_refused_nodes" in str(EXPORT_PIPELINE)


def test_a_pipeline_refuses_two_passes_of_one_name():
    with pytest.raises(ValueError, match="names \\['a'\\] twice"):
        Pipeline("p", (Pass("a", lambda s: PassResult(False)), Pass("a", lambda s: PassResult(False))))


def test_counts_are_kept_per_pass_so_a_repeated_key_is_never_overwritten():
    gm = amp_compiler.convert(LinearNormNet(), "O1", example_inputs=(torch.randn(2, 8),))
    counts = gm.meta["amp"]["pass_counts"]
    assert {"infer_dtypes:original", "infer_dtypes:painted", "decide_precision", "insert_casts"} <= set(counts)
    assert counts["decide_precision"]["low"] >= 1 and count(counts, "casts_inserted") >= 1
    assert list(counts) == [p.name for p in FX_PIPELINE.passes if p.name in counts]   # in pipeline order


def test_a_failing_pass_is_named_in_the_error(monkeypatch):
    def broken(gm):
        raise RuntimeError("boom")

    monkeypatch.setattr(importlib.import_module("amp_compiler.convert"), "fold_casts", broken)
    with pytest.raises(RuntimeError, match="boom") as caught:
        amp_compiler.convert(LinearNormNet(), "O1", example_inputs=(torch.randn(2, 8),))
    assert "in pass 'fold_casts' of the fx pipeline" in _trace(caught.value)


def test_checks_between_passes_blame_the_pass_that_broke_the_graph():
    def break_graph(gm):
        first_user = next(n for n in gm.graph.nodes if n.op == "call_module")
        first_user.append(next(n for n in gm.graph.nodes if n.op == "placeholder"))   # a use before its definition
        return PassResult(True)

    pipeline = Pipeline("test", (Pass("fine", lambda s: PassResult(False)), Pass("breaks", break_graph)),
                        check=lambda s: s.graph.lint())
    pipeline.run(torch.fx.symbolic_trace(LinearNormNet()))          # no checks asked for: nothing is checked
    gm = torch.fx.symbolic_trace(LinearNormNet())
    with checking_passes(), pytest.raises(RuntimeError) as caught:
        pipeline.run(gm)
    assert "in pass 'breaks' of the test pipeline" in _trace(caught.value)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_every_pass_keeps_the_invariants_on_fx_and_onnx(level, tmp_path):
    model, x = LinearNormNet(), torch.randn(2, 8)
    with checking_passes():
        gm = amp_compiler.convert(model, level, example_inputs=(x,))
        report = amp_compiler.export_onnx(model, (x,), tmp_path / "net.onnx", level)
        converted = amp_compiler.convert_onnx(tmp_path / "net.onnx", tmp_path / "net16.onnx", level, keep_io_types=False)
    assert gm.meta["amp"]["pass_counts"] and report.pass_counts and converted.pass_counts
    onnx.checker.check_model(onnx.load(tmp_path / "net16.onnx"), full_check=True)


def test_passes_readme_shows_the_pipelines_as_printed():
    readme = (Path(__file__).resolve().parents[1] / "passes" / "README.md").read_text()
    for pipeline in (FX_PIPELINE, ONNX_PIPELINE, EXPORT_PIPELINE):
        assert str(pipeline) in readme, f"passes/README.md: paste the printed {pipeline.name} pipeline again"
