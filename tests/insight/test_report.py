"""explain(): the summary, fp32 islands, module grouping, filters, output types, diff, torch.save."""
import io
import json

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import convert, diff, explain
from amp_compiler.saved_decisions import SAVED_ATTRIBUTE, preserve_decisions
from amp_compiler.insight.report_text import summarise_paths
from models import build


@pytest.fixture(scope="module")
def gpt():
    task = build("gpt", size="full", seed=0)      # 4 blocks: the folding has repeats to fold
    return task.model, task.example_inputs


@pytest.fixture(scope="module")
def gpt_o1(gpt):
    model, inputs = gpt
    return convert(model, "O1", example_inputs=inputs)


def test_report_opens_with_a_summary_and_folds_repeated_blocks(gpt_o1):
    text = str(explain(gpt_o1))
    lines = text.splitlines()
    assert lines[0] == ("amp-compiler report: level O1 (asked O1), float16, front end fx.symbolic_trace, "
                        "device cpu (from the model's parameters)")
    assert lines[1].startswith("nodes: ") and "float16" in lines[1] and "casts" in lines[1]
    assert lines[2].startswith("fp32 islands: ")
    assert "layers.[0-3].attention (x4): 3 nodes (mul, masked_fill, softmax); softmax: deny:" in text
    assert "layers.1 through layers.3: same decisions as layers.0 (3 blocks of" in text
    assert "leaf modules kept whole (one call each in the graph, not traced into): embedding.{positions,tokens}" in text
    # the unfolded report was 215 lines, one of them 1,386 characters (the leaf-module list)
    assert len(lines) < 100 and max(map(len, lines)) < 200
    assert lines[-1].startswith("totals: ")


def test_summary_counts_are_the_graphs(gpt_o1):
    report = explain(gpt_o1)
    nodes = [n for n in gpt_o1.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    low = sum(1 for n in nodes if n.meta["amp"].get("precision") == "low" and n.meta.get("amp_role") != "cast")
    fp32 = sum(1 for n in nodes if n.meta["amp"].get("precision") == "fp32")
    assert report.totals["nodes_per_dtype"] == {"float16": low, "float32": fp32}
    assert report.totals["casts"] == sum(1 for n in nodes if n.meta.get("amp_role") == "cast") == gpt_o1.meta["amp"]["casts"]
    assert len(report.rows) == len(nodes)
    islands = report.islands
    assert sum(len(i["nodes"]) for i in islands) == fp32
    assert {i["ops"][-1] for i in islands if i["module"].endswith("attention")} == {"softmax"}


class TwoIslands(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.softmax(self.a(x), -1) * 2            # island 1: softmax, mul
        return self.c(torch.log_softmax(self.b(h), -1))  # island 2: log_softmax


def test_islands_are_connected_fp32_nodes_with_the_rule_that_seeded_them():
    islands = explain(convert(TwoIslands(), "O1")).islands
    assert [(i["ops"], i["seed"]) for i in islands] == [(["softmax", "mul"], "softmax"), (["log_softmax"], "log_softmax")]
    assert islands[0]["rule"].startswith("deny:")


def test_filters_pick_rows_and_keep_the_summary_whole(gpt_o1):
    whole = explain(gpt_o1)
    fp32 = explain(gpt_o1, only="fp32")
    assert fp32.rows and all(r["dtype"] == "float32" and r["precision"] == "fp32" for r in fp32.rows)
    assert fp32.totals == whole.totals
    assert f"{len(fp32.rows)} of {len(whole.rows)} rows (only='fp32')" in str(fp32)
    assert {r["node"] for r in explain(gpt_o1, only="float16").rows} == \
        {r["node"] for r in whole.rows if r["dtype"] == "float16"}
    in_block = explain(gpt_o1, module="layers.2.*").rows
    assert in_block and all(r["module"].startswith("layers.2") for r in in_block)
    assert [r["node"] for r in explain(gpt_o1, op="softmax").rows] == ["softmax", "softmax_1", "softmax_2", "softmax_3"]
    assert explain(gpt_o1, only="cast", module="lm_head").rows[0]["op"] == "cast"
    with pytest.raises(ValueError, match="only='fp64'"):
        explain(gpt_o1, only="fp64")


def test_json_html_and_text_carry_the_same_rows(gpt_o1):
    report = explain(gpt_o1, module="layers.0*")
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert [r["node"] for r in data["rows"]] == [r["node"] for r in report.rows]
    assert data["summary"]["level"] == "O1" and data["filters"] == {"module": "layers.0*"}
    html = report._repr_html_()
    assert html.count("<tr style=") == len(report.rows)
    assert "fp32 islands" in html


def test_diff_names_every_node_whose_dtype_changed(gpt, gpt_o1):
    model, inputs = gpt
    o2 = convert(model, "O2", example_inputs=inputs)
    changes = diff(gpt_o1, o2)
    before, after = explain(gpt_o1), explain(o2)
    was = {r["node"]: r["dtype"] for r in before.rows if r["precision"] != "cast"}
    expected = {r["node"] for r in after.rows if r["node"] in was and was[r["node"]] != r["dtype"]}
    assert {r["node"] for r in changes.rows} == expected
    assert {"node": "softmax", "before": "float32", "after": "float16"}.items() <= \
        next(r for r in changes.rows if r["node"] == "softmax").items()
    text = str(changes)
    assert text.startswith("diff: O1 float16 -> O2 float16")
    assert f"{len(expected)} nodes changed dtype" in text
    assert str(explain(gpt_o1, o2)) == text
    assert diff(gpt_o1, gpt_o1).rows == [] and "no node changed dtype" in str(diff(gpt_o1, gpt_o1))


@pytest.mark.slow
def test_a_reloaded_module_explains_itself_when_its_decisions_were_preserved(gpt, gpt_o1):
    def reload(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    del gpt_o1.__dict__[SAVED_ATTRIBUTE]  # as before convert() preserved them
    with pytest.raises(ValueError, match="returned by amp_compiler.convert"):
        explain(reload(gpt_o1))          # fx re-traces the saved code: node.meta starts empty
    preserve_decisions(gpt_o1)           # convert() does this last
    loaded = reload(gpt_o1)
    before, after = explain(gpt_o1), explain(loaded)
    assert after.totals == before.totals and after.islands == before.islands
    assert [(r["op"], r["dtype"], r["rule"]) for r in after.rows] == [(r["op"], r["dtype"], r["rule"]) for r in before.rows]
    model, inputs = gpt
    model.eval(), loaded.eval()
    assert torch.allclose(loaded(*inputs).float(), model(*inputs), atol=0.1)


def test_a_graph_edited_after_preserving_is_refused():
    gm = convert(TwoIslands(), "O1")
    preserve_decisions(gm)
    gm.meta = {}
    cast = next(n for n in gm.graph.nodes if n.meta.get("amp_role") == "cast")
    cast.replace_all_uses_with(cast.args[0])
    gm.graph.erase_node(cast)
    with pytest.raises(ValueError, match="edited after convert"):
        explain(gm)


def test_long_path_lists_fold_numbered_repeats():
    paths = ["bn", "head"] + [f"enc.layers.{i}.{leaf}" for i in range(12) for leaf in ("attn", "ffn")]
    assert summarise_paths(paths) == ["bn", "head", "enc.layers.[0-11].{attn,ffn}"]
    assert summarise_paths(["a.0.x", "a.2.x", "a.5.x"]) == ["a.[0,2,5].x"]
    assert summarise_paths(["a.3.x"]) == ["a.3.x"]


def test_public_names():
    assert amp_compiler.diff is diff and "diff" in amp_compiler.__all__


def test_o0_reports_nothing_painted():
    text = str(explain(convert(TwoIslands(), "O0")))
    assert "nodes: none painted" in text and "0 casts" in text and "fp32 islands: none" in text


def test_printed_report_lists_the_decisions_and_counts_what_it_leaves_out(gpt_o1):
    report = explain(gpt_o1)
    lines = str(report).splitlines()
    header = next(line for line in lines if " rows: the decisions" in line)
    shown, total = (int(n) for n in header.split(" rows")[0].split(" of "))
    decisions = [row for row in report.rows if amp_compiler.insight.report.is_decision(row)]
    assert total == len(report.rows) == report.totals["rows"] and shown == len(decisions) < total
    # what the table leaves out is counted, and adds up with what it shows
    left_out = " ".join(lines[lines.index(next(line for line in lines if line.startswith("not listed: "))):][:-1])
    counted = [int(word) for word in left_out.replace(",", " ").split() if word.isdigit()]
    assert shown + sum(counted) == total, left_out
    kinds = {(row["precision"], row["rule"].split(":")[0]) for row in decisions}
    assert ("low", "clear") not in kinds and ("low", "infer") not in kinds and ("untouched", "") not in kinds
    assert {row["precision"] for row in decisions} == {"low", "fp32", "cast"}
    assert all(row["precision"] == "fp32" for row in report.rows if row not in decisions and
               row["precision"] == "fp32") is True and all(row in decisions for row in report.rows
                                                          if row["precision"] == "fp32")
    # a weight's copy is named by its parameter, and left out of the default table
    weights = [row for row in report.rows if row["weight"]]
    assert weights and all(row["precision"] == "cast" and row not in decisions for row in weights)
    assert "lm_head.weight" in {row["weight"] for row in weights}


def test_full_and_filters_list_every_row_they_keep(gpt_o1):
    everything = str(explain(gpt_o1, full=True))
    report = explain(gpt_o1)
    assert f"all {len(report.rows)} rows, by module" in everything and "not listed" not in everything
    assert len(everything.splitlines()) > len(str(report).splitlines())
    clear = next(row for row in report.rows if row["rule"].startswith("clear:") and row["precision"] == "low")
    assert f"  {clear['node']} " in everything and f"  {clear['node']} " not in str(report)
    low = explain(gpt_o1, only="low")
    assert f" {clear['node']} " in str(low)   # a filter's rows are all listed


def test_in_place_weight_casts_are_named_by_their_parameter():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model = convert(model, "O1", dtype=torch.bfloat16, inplace=True)
    model(torch.randn(3, 4))    # dynamo: the weights are the graph's inputs
    report = explain(model)
    named = {row["weight"] for row in report.rows if row["weight"]}
    # (a bf16 linear on this CPU may read its fp32 weight through oneDNN's packed copy: no cast of it then)
    assert {"0.bias", "2.bias"} <= named <= {name for name, _ in model.named_parameters()}
    assert "_parameters_" not in str(report)     # dynamo's placeholder names stay out of the default table
