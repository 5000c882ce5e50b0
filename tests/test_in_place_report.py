"""explain / render / compare / verify / freeze on a model converted in place (convert(model, inplace=True, capture="parts")).

One report with the parts merged: rows under the user's module paths (a part's graph names them "inner.x"),
a "parts:" block saying which parts run graphs, which run as written and why, and their captures; freeze()
reaching the part graphs captured before and after it; compare() against the model run as written.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.in_place import in_place_conversion
from amp_compiler.in_place.report import NOT_CALLED, running_as_written
from amp_compiler.passes.node_facts import facts

BF16 = torch.bfloat16


class Block(nn.Module):
    """A residual MLP block (norm, up, down), like a transformer layer's."""
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class State:
    """A non-tensor argument (like a KV cache object): the part taking it runs as written."""
    def __init__(self, scale):
        self.scale = scale


class TakesObject(nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x, state: State):
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x * state.scale


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:   # data-dependent: no capture can take it
            return self.lin(x)
        return -self.lin(x)


class BranchInChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.branchy = Branchy()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.branchy(x))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def converted(model, *inputs):
    """model converted in place at O1 bf16 and called once (its parts captured)."""
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    with torch.no_grad():
        model(*inputs)
    return model


def parts_summary(model):
    return amp_compiler.explain(model).summary["parts"]


def row_key(row):   # node names differ: a part's graph calls its inputs input_0 and its weights inner_...
    return row["module"], row["op"], row["precision"], row["dtype"]


# -- explain ------------------------------------------------------------------------------------------------
def test_a_model_captured_whole_reports_the_rows_convert_reports():
    x = torch.randn(4, 16)
    whole = amp_compiler.explain(amp_compiler.convert(mlp(), "O1", dtype=BF16))
    report = amp_compiler.explain(converted(mlp(), x))
    assert [row_key(r) for r in report.rows] == [row_key(r) for r in whole.rows]
    assert report.totals == whole.totals
    assert report.summary["parts"] == {"": {"status": "graph", "captures": 1, "graphs": 1, "reasons": []}}
    assert "parts: 1 graph (1 captures)" in str(report) and "graphs (1): (top level)" in str(report)


def test_before_any_call_it_says_nothing_is_captured_yet():
    model = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True, capture="parts")
    report = amp_compiler.explain(model)
    assert report.rows == [] and NOT_CALLED in report.summary["notes"]
    assert report.summary["parts"][""]["status"] == "not called yet"
    text = str(report)
    assert "call the model once or pass" in text and "not called yet (1): (top level)" in text


def test_an_object_argument_runs_the_root_as_written_and_its_children_report_under_their_paths():
    x = torch.randn(4, 16)
    model = converted(TakesObject(), x, State(2.0))
    report = amp_compiler.explain(model)
    names = dict(model.named_modules())
    assert report.rows and all(row["module"] in names for row in report.rows)   # the user's paths, no "inner"
    assert {"proj", "layers.0", "layers.1.up", "layers.1.down"} <= {row["module"] for row in report.rows}
    parts = report.summary["parts"]
    assert parts[""]["status"] == "as written" and "State" in parts[""]["reasons"][0]
    assert {path for path, p in parts.items() if p["status"] == "graph"} == {"proj", "layers.0", "layers.1"}
    text = str(report)
    assert "parts: 3 graphs, 1 as written (3 captures)" in text   # the root never captured
    assert "graphs (3): proj, layers.[0-1]" in text
    assert "as written (1), called with a " in text and "State argument" in text
    # the leaf modules' rows sit under their parent block, the second block folded onto the first
    assert "layers.1: same decisions as layers.0" in text


def test_numbered_parts_fold_into_one_line_per_reason():
    x = torch.randn(2, 16)
    model = converted(TakesObject(blocks=6), x, State(1.0))
    lines = [line for line in str(amp_compiler.explain(model)).splitlines()
             if line.startswith("  graphs")]
    assert lines == ["  graphs (7): proj, layers.[0-5]"]


def test_an_untraceable_child_runs_as_written_with_the_reason_and_its_child_is_a_graph():
    model = converted(BranchInChild(), torch.randn(4, 16).abs())
    report = amp_compiler.explain(model)
    parts = report.summary["parts"]
    assert parts[""]["status"] == "as written" and "branchy cannot be traced" in parts[""]["reasons"][0]
    assert parts["branchy"]["status"] == "as written"
    assert parts["branchy.lin"] == {"status": "graph", "captures": 1, "graphs": 1, "reasons": []}
    assert parts["head"]["status"] == "graph"
    assert {row["module"] for row in report.rows if row["op"] == "linear"} == {"branchy.lin", "head"}
    assert "inner" not in "\n".join(report.summary_lines())


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.proj(x))


def test_a_part_with_train_and_eval_graphs_counts_both_and_shows_the_latest():
    model = amp_compiler.convert(Dropping(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    model(x)
    model.eval()
    model(x)
    part = in_place_conversion(model).parts[""]
    eval_graph = next(graph for key, graphs in part.graphs.items() if key[0] is False for graph in graphs)
    report = amp_compiler.explain(model)
    assert report.summary["parts"][""] == {"status": "graph", "captures": 2, "graphs": 2, "reasons": []}
    assert [r["node"] for r in report.rows] == [r["node"] for r in amp_compiler.explain(eval_graph.gm).rows]
    assert "graphs (1), 2 captures and 2 graphs each (rows: the latest)" in str(report)


def test_calibration_shows_as_convert_shows_it():
    torch.manual_seed(0)
    samples = [(torch.randn(4, 16),), (torch.randn(4, 16) * 3e4,)]   # past float16's range
    whole = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, calibration_data=samples)
    model = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, inplace=True, capture="parts", calibration_data=samples)
    with torch.no_grad():
        model(torch.randn(4, 16))
    line = [line for line in str(amp_compiler.explain(whole)).splitlines() if line.startswith("range calibration")]
    counts = line[0].rpartition(":")[0]   # "range calibration (2 samples): 1 node kept fp32" (node names differ)
    assert "0 nodes" not in counts and counts in str(amp_compiler.explain(model))


def test_html_json_and_filters_work_on_the_merged_report():
    model = converted(TakesObject(), torch.randn(4, 16), State(1.0))
    report = amp_compiler.explain(model, module="layers.1.*")
    assert report.rows and all(row["module"].startswith("layers.1") for row in report.rows)
    html = report._repr_html_()
    # paths are the user's ("inner." gone); node names keep fx's inner_ prefix
    assert "parts: 3 graphs" in html and "layers.1.up" in html and "inner." not in html
    assert report.to_dict()["summary"]["parts"]["proj"]["status"] == "graph"


# -- render -------------------------------------------------------------------------------------------------
def test_render_writes_the_parts_under_the_user_paths(tmp_path):
    model = converted(TakesObject(), torch.randn(4, 16), State(1.0))
    page = amp_compiler.render(model, tmp_path / "graph.html").read_text()
    view = json.loads(page.split('id="amp-data">')[1].split("</script>")[0])
    assert set(view["modules"]) == {"proj", "layers.0", "layers.0.norm", "layers.0.up", "layers.0.down",
                                    "layers.1", "layers.1.norm", "layers.1.up", "layers.1.down"}
    reads = {name for node in view["nodes"] for name in node["reads"]}
    assert reads == {name for name, _ in model.named_parameters() if ".norm." not in name}   # norms: module calls
    assert any(line.startswith("parts: 3 graphs") for line in view["summary"])
    svg = amp_compiler.render(model, tmp_path / "graph.svg").read_text()
    assert "layers.1.up" in svg and "inner." not in svg


def test_render_before_any_call_writes_an_empty_picture(tmp_path):
    model = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True, capture="parts")
    assert "nothing captured yet" in amp_compiler.render(model, tmp_path / "graph.html").read_text()


# -- compare and verify -------------------------------------------------------------------------------------
def test_running_as_written_is_the_fp32_model_and_puts_the_parts_back():
    x = torch.randn(4, 16)
    model = TakesObject()
    reference = copy.deepcopy(model)
    converted(model, x, State(1.0))
    with running_as_written(model):
        assert torch.equal(model(x, State(1.0)), reference(x, State(1.0)))
    assert not torch.equal(model(x, State(1.0)), reference(x, State(1.0)))   # the graphs run again


@pytest.mark.parametrize("separate_reference", [False, True])
def test_compare_measures_the_outputs_against_the_fp32_model(separate_reference):
    x = torch.randn(4, 16)
    model = TakesObject()
    fp32 = copy.deepcopy(model)
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")   # compare's own call captures the parts
    report = amp_compiler.compare(fp32 if separate_reference else model, model, (x, State(2.0)))
    with torch.no_grad():
        expected = (model(x, State(2.0)).double() - fp32(x, State(2.0)).double()).abs().max().item()
    assert len(report.outputs) == 1 and report.outputs[0].max_abs == pytest.approx(expected)
    assert report.errors and all("inner" not in e.module for e in report.errors)
    assert {e.module for e in report.errors if e.op == "linear"} == {"proj", "layers.0.up", "layers.0.down",
                                                                    "layers.1.up", "layers.1.down"}
    assert report.passed and not report.notes


def test_compare_of_a_model_with_nothing_low_has_no_node_errors():
    x = torch.randn(4, 16)
    model = amp_compiler.convert(mlp(), "O0", inplace=True, capture="parts")
    report = amp_compiler.compare(model, model, (x,))
    assert report.errors == [] and report.outputs[0].max_abs == 0.0


def test_compare_names_the_first_failing_node_with_its_part_path():
    x = torch.randn(4, 16)
    model = converted(TakesObject(), x, State(1.0))
    report = amp_compiler.compare(model, model, (x, State(1.0)), rtol=1e-9)
    assert not report.passed and report.first_failure.module.startswith("proj")   # the first part called
    assert report.chain[-1] is report.first_failure


def test_verify_checks_every_part_graph_and_names_the_part():
    x = torch.randn(4, 16)
    model = amp_compiler.convert(TakesObject(), "O1", dtype=BF16, inplace=True, capture="parts")
    assert amp_compiler.verify(model, x, State(1.0)) is None   # its first call captures
    gm = next(iter(in_place_conversion(model).parts["layers.1"].graphs.values()))[0].gm
    linear = next(node for node in gm.graph.nodes if facts(node).get("op") == "linear")
    facts(linear)["dtype"] = torch.float64   # a wrong record: the graph computes bfloat16 there
    with pytest.raises(amp_compiler.DtypeMismatch, match="part layers.1: node"):
        amp_compiler.verify(model, x, State(1.0))


# -- freeze -------------------------------------------------------------------------------------------------
def low_bytes(model):
    """What bf16 copies of all of the model's parameters take (every MLP weight and bias is read low)."""
    return sum(p.numel() * 2 for p in model.parameters())


def test_freeze_after_the_first_call_freezes_the_part_graphs_and_keeps_the_outputs():
    x = torch.randn(4, 16)
    model = converted(TakesObject().eval(), x, State(1.0))
    with torch.no_grad():
        unfrozen = model(x, State(1.0))
    assert amp_compiler.freeze(model) is model and amp_compiler.frozen_bytes(model) == 0   # copies on a call
    with torch.no_grad():
        frozen = model(x, State(1.0))
    norms = sum(p.numel() * 2 for name, p in model.named_parameters() if ".norm." in name)   # fp32: no copy
    assert amp_compiler.frozen_bytes(model) == low_bytes(model) - norms
    assert torch.equal(frozen, unfrozen)


@pytest.mark.parametrize("how", ["freeze() before any call", "convert(freeze=True)"])
def test_graphs_captured_after_freezing_are_frozen_too(how):
    x = torch.randn(4, 16)
    model, reference = mlp(), mlp()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts", freeze=how.startswith("convert"))
    amp_compiler.convert(reference, "O1", dtype=BF16, inplace=True, capture="parts")
    if how.startswith("freeze"):
        amp_compiler.freeze(model, sample_values=False)
    with torch.no_grad():
        out = model(x)
    assert amp_compiler.frozen_bytes(model) == low_bytes(model)
    with torch.no_grad():
        assert torch.equal(out, reference(x))
    holder = in_place_conversion(model).graph_modules()[0].get_submodule("amp_frozen_weights")
    assert holder.sample_values is not how.startswith("freeze")


def test_training_calls_of_a_frozen_part_cast_the_weights_as_before():
    x = torch.randn(4, 16)
    model = amp_compiler.freeze(amp_compiler.convert(mlp().train(), "O1", dtype=BF16, inplace=True, capture="parts"))
    model(x).sum().backward()   # a train-mode graph: its copies are not used, the gradients reach the weights
    assert amp_compiler.frozen_bytes(model) == 0 and model[0].weight.grad is not None


# -- a tiny Hugging Face Llama ------------------------------------------------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.real_models
@pytest.mark.slow   # the parts capture in ~15 s on 2 busy cores
def test_llama_explain_names_the_cache_taking_parts_and_the_graphs(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 5))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    with torch.no_grad():   # generate() passes a DynamicCache: the levels that get it run as written
        model.generate(ids, max_new_tokens=2, do_sample=False)
    report = amp_compiler.explain(model)
    names = dict(model.named_modules())
    assert all(row["module"] in names for row in report.rows)
    parts = report.summary["parts"]
    for layer in ("model.layers.0", "model.layers.1.self_attn"):
        assert parts[layer]["status"] == "as written" and "DynamicCache" in parts[layer]["reasons"][0]
    assert parts["model.layers.1.self_attn.q_proj"] == {"status": "graph", "captures": 1, "graphs": 1, "reasons": []}
    text = "\n".join(report.summary_lines())
    assert "model.layers.[0-1].self_attn.{q_proj,k_proj,v_proj,o_proj}" in text
    assert "DynamicCache argument" in text and "model.layers.[0-1]" in text and "model.layers.[0-1].self_attn\n" in text
    assert "model.layers.1: same decisions as model.layers.0" in str(report)
    assert "model.layers.0.mlp.up_proj" in amp_compiler.render(model, tmp_path / "llama.html").read_text()


@pytest.mark.real_models
@pytest.mark.slow   # the parts capture in ~15 s on 2 busy cores
def test_llama_frozen_generates_the_same_tokens_and_compare_and_verify_run():
    model = tiny_llama()
    fp32 = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 5))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    with torch.no_grad():
        unfrozen = model.generate(ids, max_new_tokens=4, do_sample=False)
        amp_compiler.freeze(model)
        frozen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(frozen, unfrozen) and amp_compiler.frozen_bytes(model) > 0
    report = amp_compiler.compare(model, model, (ids,))
    with torch.no_grad():
        expected = (model(ids).logits.double() - fp32(ids).logits.double()).abs().max().item()
    assert report.outputs[0].max_abs == pytest.approx(expected) and report.errors
    names = dict(model.named_modules())
    assert report.errors and all(e.module in names for e in report.errors)   # the user's paths
    assert amp_compiler.verify(model, ids) is None
