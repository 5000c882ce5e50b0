"""explain / render / compare / verify / freeze on a model converted in place (convert(model, inplace=True)).

On TorchDynamo's capture: one report of every graph dynamo made, rows under the user's module paths, the summary's
front end saying how many graphs, graph breaks and recompiles; freeze() setting the weight cache's options for the
graphs made before and after it; compare() against the model run as written.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.report import NOT_CALLED, running_as_written
from amp_compiler.passes.node_facts import facts

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """A residual MLP block (norm, up, down), like a transformer layer's."""
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class State:
    """A non-tensor argument (like a KV cache object): dynamo reads its attributes into the graph."""
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
        if x.sum() > 0:   # data-dependent: a graph break
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


def converted(model, *inputs, **options):
    """model converted in place at O1 bf16 and called once (its graphs made)."""
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, **options)
    with torch.no_grad():
        model(*inputs)
    return model


def row_key(row):   # node names differ: dynamo names its inputs l_args_0_ and its weights l_module_modules_...
    return row["module"], row["op"], row["precision"], row["dtype"]


# -- explain ------------------------------------------------------------------------------------------------
def test_a_model_captured_whole_reports_the_rows_convert_reports():
    x = torch.randn(4, 16)
    whole = amp_compiler.explain(amp_compiler.convert(mlp(), "O1", dtype=BF16))
    # weight_cache=False: convert() keeps no weight copies either (with the cache, the weights' casts are cached
    # copies and a frozen-check row is added: test_freeze_after_the_first_call_...)
    report = amp_compiler.explain(converted(mlp(), x, weight_cache=False))
    assert [row_key(r) for r in report.rows] == [row_key(r) for r in whole.rows]
    assert report.totals == whole.totals
    assert report.summary["frontend"] == "torch.dynamo: 1 graph(s), 0 graph break(s), 0 recompile(s)"
    assert report.summary["in_place"] is True


def test_before_any_call_it_says_nothing_is_captured_yet():
    model = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True)
    report = amp_compiler.explain(model)
    assert report.rows == [] and report.summary["notes"] == [NOT_CALLED]
    assert report.summary["frontend"].startswith("torch.dynamo: 0 graph(s)")
    assert "not called yet" in str(report)


def test_an_object_argument_is_captured_and_the_rows_are_under_the_users_paths():
    x = torch.randn(4, 16)
    model = converted(TakesObject(), x, State(2.0))
    report = amp_compiler.explain(model)
    names = dict(model.named_modules())
    assert report.rows and all(row["module"] in names for row in report.rows)   # the user's paths
    linears = {row["module"] for row in report.rows if row["op"] == "linear"}
    assert linears == {"proj", "layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"}
    assert {row["precision"] for row in report.rows if row["op"] == "linear"} == {"low"}
    assert report.summary["frontend"] == "torch.dynamo: 1 graph(s), 0 graph break(s), 0 recompile(s)"
    text = str(report)
    assert "layers.[0-1].norm (x2)" in text   # the norms' fp32 islands, folded
    assert "dynamo" in text and "State" not in text   # (the parts' report named the State argument's parts)
    # (the parts' "layers.1: same decisions as layers.0" fold is gone: in one graph layers.0 ends with the cast
    # into layers.1's fp32 norm, layers.1 with none, so the two blocks' rows differ)


def test_an_untraceable_child_breaks_the_graph_and_both_sides_report_under_the_users_paths():
    model = converted(BranchInChild(), torch.randn(4, 16).abs())
    report = amp_compiler.explain(model)
    assert "1 graph break(s)" in report.summary["frontend"]
    assert {row["precision"] for row in report.rows if row["op"] == "linear"} == {"low"}
    assert {row["module"] for row in report.rows if row["op"] == "linear"} == {"branchy.lin", "head"}
    assert "inner" not in "\n".join(report.summary_lines())


def test_calibration_shows_as_convert_shows_it():
    torch.manual_seed(0)
    samples = [(torch.randn(4, 16),), (torch.randn(4, 16) * 3e4,)]   # past float16's range
    whole = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, calibration_data=samples)
    model = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, inplace=True, calibration_data=samples)
    with torch.no_grad():
        model(torch.randn(4, 16))
    line = [line for line in str(amp_compiler.explain(whole)).splitlines() if line.startswith("range calibration")]
    counts = line[0].rpartition(":")[0]   # "range calibration (2 samples): 1 node kept fp32" (node names differ)
    assert "0 nodes" not in counts and counts in str(amp_compiler.explain(model))


def test_html_json_and_filters_work_on_the_merged_report():
    model = converted(TakesObject(), torch.randn(4, 16), State(1.0))
    report = amp_compiler.explain(model, module="layers.1.*")
    assert report.rows and all(row["module"].startswith("layers.1") for row in report.rows)
    assert {row["module"] for row in report.rows if row["op"] == "linear"} == {"layers.1.up", "layers.1.down"}
    html = report._repr_html_()
    assert "torch.dynamo: 1 graph(s)" in html and "layers.1.up" in html and "L[&#x27;" not in html
    assert "L['" not in html
    assert report.to_dict()["summary"]["frontend"].startswith("torch.dynamo: 1 graph(s)")


# -- render -------------------------------------------------------------------------------------------------
def test_render_writes_the_graphs_under_the_user_paths(tmp_path):
    model = converted(TakesObject(), torch.randn(4, 16), State(1.0))
    page = amp_compiler.render(model, tmp_path / "graph.html").read_text()
    view = json.loads(page.split('id="amp-data">')[1].split("</script>")[0])
    assert set(view["modules"]) == {"", "proj", "layers.0", "layers.0.norm", "layers.0.up", "layers.0.down",
                                    "layers.1", "layers.1.norm", "layers.1.up", "layers.1.down"}
    # dynamo's weights are graph inputs, not get_attr reads: the only read is the weight cache's holder
    reads = {name for node in view["nodes"] for name in node["reads"]}
    assert reads <= {"amp_frozen_weights"}
    assert any(line.startswith("note: graph 1 (compile id") for line in view["summary"])
    svg = amp_compiler.render(model, tmp_path / "graph.svg").read_text()
    assert "layers.1.up" in svg and "L['" not in svg


def test_render_before_any_call_writes_an_empty_picture(tmp_path):
    model = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True)
    assert "not called yet" in amp_compiler.render(model, tmp_path / "graph.html").read_text()


# -- compare and verify -------------------------------------------------------------------------------------
def test_running_as_written_is_the_fp32_model_and_puts_the_compilation_back():
    x = torch.randn(4, 16)
    model = TakesObject()
    reference = copy.deepcopy(model)
    converted(model, x, State(1.0))
    forward = compiled_record(model)
    with running_as_written(model):
        assert torch.equal(model(x, State(1.0)), reference(x, State(1.0)))
    assert model.__dict__["forward"] is forward
    assert not torch.equal(model(x, State(1.0)), reference(x, State(1.0)))   # the graphs run again


@pytest.mark.parametrize("separate_reference", [False, True])
def test_compare_measures_the_outputs_against_the_fp32_model(separate_reference):
    x = torch.randn(4, 16)
    model = TakesObject()
    fp32 = copy.deepcopy(model)
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)   # compare's own call makes the graph
    report = amp_compiler.compare(fp32 if separate_reference else model, model, (x, State(2.0)))
    with torch.no_grad():
        expected = (model(x, State(2.0)).double() - fp32(x, State(2.0)).double()).abs().max().item()
    assert len(report.outputs) == 1 and report.outputs[0].max_abs == pytest.approx(expected) and expected > 0
    names = dict(model.named_modules())
    assert report.errors and all(e.module in names for e in report.errors)
    assert {e.module for e in report.errors if e.op == "linear"} == {"proj", "layers.0.up", "layers.0.down",
                                                                    "layers.1.up", "layers.1.down"}
    assert report.passed and not report.notes   # one graph call: no note on several
    assert len(graphs(model)) == 1


def test_compare_of_a_model_with_nothing_low_has_no_node_errors():
    x = torch.randn(4, 16)
    model = amp_compiler.convert(mlp(), "O0", inplace=True)
    report = amp_compiler.compare(model, model, (x,))
    # the parts reported no node at O0; dynamo's graph is replayed node by node like any other (its weights are
    # placeholders, measured too): every node exact and fp32
    assert report.errors and all(e.max_abs == 0.0 and e.dtype == "float32" for e in report.errors), report.errors
    assert report.outputs[0].max_abs == 0.0 and report.passed


def test_compare_names_the_first_failing_node_with_its_module_path():
    x = torch.randn(4, 16)
    model = converted(TakesObject(), x, State(1.0))
    report = amp_compiler.compare(model, model, (x, State(1.0)), rtol=1e-9)
    assert not report.passed and report.first_failure.module.startswith("proj")   # the first module called
    assert report.first_failure.node.startswith("graph 1: ")
    assert report.chain[-1] is report.first_failure


def test_verify_checks_every_graph_and_names_the_graph():
    x = torch.randn(4, 16)
    model = amp_compiler.convert(TakesObject(), "O1", dtype=BF16, inplace=True)
    assert amp_compiler.verify(model, x, State(1.0)) is None   # its first call makes the graph
    gm = graphs(model)[0]
    linear = next(node for node in gm.graph.nodes
                  if facts(node).get("op") == "linear" and facts(node).get("module") == "layers.1.up")
    facts(linear)["dtype"] = torch.float64   # a wrong record: the graph computes bfloat16 there
    with pytest.raises(amp_compiler.DtypeMismatch, match=f"graph 1 .*{linear.name}"):
        amp_compiler.verify(model, x, State(1.0))


# -- freeze -------------------------------------------------------------------------------------------------
def low_bytes(model):
    """What bf16 copies of all of the model's parameters take (every MLP weight and bias is read low)."""
    return sum(p.numel() * 2 for p in model.parameters())


def test_freeze_after_the_first_call_keeps_the_outputs_and_the_cache_holds_the_low_weights():
    x = torch.randn(4, 16)
    model = converted(TakesObject().eval(), x, State(1.0))
    with torch.no_grad():
        unfrozen = model(x, State(1.0))
    norms = sum(p.numel() * 2 for name, p in model.named_parameters() if ".norm." in name)   # fp32: no copy
    # the weight cache is on by default: the first inference call made the copies (the parts made them after freeze)
    assert amp_compiler.frozen_bytes(model) == low_bytes(model) - norms
    assert amp_compiler.freeze(model) is model
    with torch.no_grad():
        frozen = model(x, State(1.0))
    assert amp_compiler.frozen_bytes(model) == low_bytes(model) - norms
    assert torch.equal(frozen, unfrozen)


@pytest.mark.parametrize("how", ["freeze() before any call", "convert(freeze=True)"])
def test_graphs_captured_after_freezing_are_frozen_too(how):
    x = torch.randn(4, 16)
    model, reference = mlp(), mlp()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, freeze=how.startswith("convert"))
    amp_compiler.convert(reference, "O1", dtype=BF16, inplace=True, weight_cache=False)
    if how.startswith("freeze"):
        amp_compiler.freeze(model, sample_values=False)
    with torch.no_grad():
        out = model(x)
    assert amp_compiler.frozen_bytes(model) == low_bytes(model)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-6)   # packed linears: oneDNN's sums
    holder = graphs(model)[0].get_submodule("amp_frozen_weights")
    assert holder.sample_values is not how.startswith("freeze")


def test_training_calls_of_a_frozen_model_cast_the_weights_as_before():
    x = torch.randn(4, 16)
    model = amp_compiler.freeze(amp_compiler.convert(mlp().train(), "O1", dtype=BF16, inplace=True))
    model(x).sum().backward()   # a train-mode graph: its copies are not used, the gradients reach the weights
    assert graphs(model)
    assert amp_compiler.frozen_bytes(model) == 0 and model[0].weight.grad is not None


# -- a tiny Hugging Face Llama ------------------------------------------------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.real_models
@pytest.mark.slow   # dynamo's prefill and decode graphs of a Llama in seconds on 2 busy cores
def test_llama_explain_names_the_users_paths_in_the_prefill_and_decode_graphs(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 5))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    with torch.no_grad():   # generate() makes a prefill graph and decode graphs
        model.generate(ids, max_new_tokens=3, do_sample=False)
    report = amp_compiler.explain(model)
    names = dict(model.named_modules())
    assert report.rows and all(row["module"] in names for row in report.rows)
    assert len(graphs(model)) >= 2 and report.summary["frontend"].startswith(f"torch.dynamo: {len(graphs(model))} ")
    attention = [row for row in report.rows if row["op"] == "scaled_dot_product_attention"]
    assert {row["module"] for row in attention} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert {row["precision"] for row in attention} == {"low"} and len(attention) >= 2 * 2   # prefill, decode
    projections = {row["module"] for row in report.rows if row["op"] == "linear"}
    assert {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")} \
        <= projections
    assert "model.layers.0.mlp.up_proj" in amp_compiler.render(model, tmp_path / "llama.html").read_text()


@pytest.mark.real_models
@pytest.mark.slow   # dynamo's prefill and decode graphs of a Llama in seconds on 2 busy cores
def test_llama_frozen_generates_the_same_tokens_and_compare_and_verify_run():
    model = tiny_llama()
    fp32 = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 5))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
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
