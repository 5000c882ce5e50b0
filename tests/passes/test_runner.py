"""The pass runner: pipelines print, counts are kept per pass, a failing pass is named, checks run between passes."""
import importlib
import traceback
from pathlib import Path

import onnx
import pytest
import torch

import amp_compiler
from amp_compiler.passes.pipelines import (EXPORT_PIPELINE, FX_PAINTING_HOOKS, FX_PIPELINE, ONNX_PIPELINE,
                                          with_listings_updated)
from amp_compiler.passes.node_facts import NodeFacts
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

    monkeypatch.setattr(importlib.import_module("amp_compiler.passes.pipelines"), "fold_casts", broken)
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


@pytest.mark.slow
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
    readme = (Path(__file__).resolve().parents[2] / "passes" / "README.md").read_text()
    for pipeline in (FX_PIPELINE, ONNX_PIPELINE, EXPORT_PIPELINE):
        assert str(pipeline) in readme, f"passes/README.md lacks the {pipeline.name} pipeline's listing"
    for doc in ("passes/README.md", "docs/how-it-works.md"):   # the listings are generated: none is stale
        text = (Path(__file__).resolve().parents[2] / doc).read_text()
        assert with_listings_updated(text) == text, f"run: amp-compiler pipelines --update {doc}"


def test_stale_listings_are_regenerated_and_others_left_alone():
    stale = "```\nfx pipeline:\n  1. canonicalize\n```\n\n```\nsome other code\n```"
    updated = with_listings_updated(stale)
    assert str(FX_PIPELINE) in updated and "decide_precision" in updated and "some other code" in updated


def test_decide_precision_prints_the_hooks_it_composes():
    text = str(FX_PIPELINE)
    lines = text.splitlines()
    decide = next(i for i, line in enumerate(lines) if "decide_precision" in line)
    assert lines[decide + 1].strip() == "- keep_upcasts_fp32" and "- place_casts (cast_placement)" in text
    assert [hook.name for hook in FX_PAINTING_HOOKS] == [line.strip()[2:] for line in lines[decide + 1:]
                                                        if line.strip().startswith("- ")]


def _facts_pipeline(*passes, front_end=()):
    return Pipeline("test", passes, nodes=lambda gm: list(gm.graph.nodes), front_end_facts=front_end)


def _write_op(gm):
    for node in gm.graph.nodes:
        node.meta.setdefault("amp", {})["op"] = node.name
    return PassResult(False)


def test_a_pass_that_writes_an_undeclared_fact_is_named_with_the_node():
    def paints(gm):
        next(n for n in gm.graph.nodes if n.op == "call_module").meta["amp"]["precision"] = "low"
        return PassResult(False)

    pipeline = _facts_pipeline(Pass("names", _write_op, writes=("op",)), Pass("paints", paints, writes=("rule",)))
    pipeline.run(torch.fx.symbolic_trace(LinearNormNet()))          # no checks asked for: nothing is checked
    with checking_passes(), pytest.raises(RuntimeError, match="pass 'paints' wrote facts \\['precision'\\]") as caught:
        pipeline.run(torch.fx.symbolic_trace(LinearNormNet()))
    assert "on node 'fc'" in str(caught.value) and "in pass 'paints' of the test pipeline" in _trace(caught.value)


def test_a_pass_that_reads_an_undeclared_fact_is_named():
    def reads_op(gm):
        return PassResult(False, {"ops": sum(1 for n in gm.graph.nodes if n.meta["amp"].get("op"))})

    with checking_passes():
        _facts_pipeline(Pass("names", _write_op, writes=("op",)), Pass("reads", reads_op, reads=("op",))).run(
            torch.fx.symbolic_trace(LinearNormNet()))
        with pytest.raises(RuntimeError, match="pass 'reads' read facts \\['op'\\]"):
            _facts_pipeline(Pass("names", _write_op, writes=("op",)), Pass("reads", reads_op)).run(
                torch.fx.symbolic_trace(LinearNormNet()))


def test_a_pipeline_refuses_a_read_that_no_earlier_pass_writes():
    with pytest.raises(ValueError, match="pass 'reads': reads \\['op'\\], which no earlier pass"):
        _facts_pipeline(Pass("reads", lambda s: PassResult(False), reads=("op",)), Pass("names", _write_op, writes=("op",)))
    with pytest.raises(ValueError, match="\\['colour'\\] are not in node_facts.py"):
        _facts_pipeline(Pass("paints", lambda s: PassResult(False), writes=("colour",)))
    _facts_pipeline(Pass("reads", lambda s: PassResult(False), reads=("hooks",)), front_end=("hooks",))


def _declared_writers() -> dict[str, set[str]]:
    """fact -> "pass (fx)" / "pass (onnx)" for every pipeline's declarations; one name for a pass both IRs have."""
    writers: dict[str, dict[str, set[str]]] = {}
    for pipeline, ir in ((FX_PIPELINE, "fx"), (ONNX_PIPELINE, "onnx"), (EXPORT_PIPELINE, "onnx")):
        for fact in pipeline.front_end_facts if pipeline is not EXPORT_PIPELINE else ():   # its nodes carry none
            writers.setdefault(fact, {}).setdefault("front end", set()).add(ir)
        for step in pipeline.passes:
            for fact in step.writes:
                writers.setdefault(fact, {}).setdefault(step.name.split(":")[0], set()).add(ir)
    return {fact: {name if irs == {"fx", "onnx"} else f"{name} ({irs.pop()})" for name, irs in by_pass.items()}
            for fact, by_pass in writers.items()}


def test_node_facts_names_the_passes_that_declare_each_fact():
    source = (Path(__file__).resolve().parents[2] / "passes" / "node_facts.py").read_text()
    documented, fact = {}, None
    table = source[source.index("NodeFacts = TypedDict"):source.index("}, total=False)")]
    for line in table.splitlines()[1:]:
        key, _, comment = line.partition("#")
        if key.strip().startswith('"'):
            fact = key.split('"')[1]
            documented[fact] = comment
        elif fact is not None and not key.strip() and comment:
            documented[fact] += comment          # the comment goes on under its key
    documented = {f: {w.strip() for w in c.split(":", 1)[0].split(",")} for f, c in documented.items()}
    assert set(documented) == set(NodeFacts.__annotations__)
    declared = _declared_writers()
    assert {f: documented[f] for f in documented} == {f: declared.get(f, set()) for f in documented}, \
        "passes/node_facts.py: the writers of each fact must be the passes whose Pass(writes=...) names it"


def test_the_cli_prints_every_pipeline_and_updates_listings(capsys, tmp_path):
    from amp_compiler.cli import main
    assert main(["pipelines"]) == 0
    printed = capsys.readouterr().out
    assert all(str(p) in printed for p in (FX_PIPELINE, ONNX_PIPELINE, EXPORT_PIPELINE))
    assert main(["pipelines", "--facts"]) == 0 and "reads op; writes dtype" in capsys.readouterr().out
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n```\nexport_onnx pipeline:\n  1. stale\n```\n")
    assert main(["pipelines", "--update", str(doc)]) == 0
    assert doc.read_text() == f"intro\n```\n{EXPORT_PIPELINE}\n```\n"
