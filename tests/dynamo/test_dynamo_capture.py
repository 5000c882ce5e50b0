"""amp_compiler.compile: the fx pipeline on the graphs TorchDynamo captures (amp_compiler/dynamo/)."""
import copy

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.passes.node_facts import facts

MATMUL_FAMILIES = ("matmul", "attention")   # op_policy families: linear/matmul/bmm/... and sdpa


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def matmul_precisions(model) -> list[tuple[str, str | None]]:
    """(node, precision) of every matmul and attention node of the model's converted graphs."""
    return [(n.name, facts(n).get("precision")) for gm in graphs(model) for n in gm.graph.nodes
            if facts(n).get("family") in MATMUL_FAMILIES]


def tiny_llama():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_tiny_llama_compiled_eager_runs_every_matmul_low_within_twice_autocasts_error_and_trains():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        with torch.autocast("cpu", torch.bfloat16):
            autocast_error = (model(ids, use_cache=False).logits.float() - reference).abs().max().item()
    assert amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager") is model   # the user's object
    with torch.no_grad():
        error = (model(ids, use_cache=False).logits.float() - reference).abs().max().item()
    precisions = matmul_precisions(model)
    assert len(precisions) >= 14 and all(p == "low" for _, p in precisions), precisions   # 7 linears a layer + head
    assert error <= 2 * autocast_error, (error, autocast_error)
    gm = graphs(model)[0]
    assert gm.meta["amp"]["frontend"] == "torch.dynamo"
    names = {v["name"] for v in gm.meta["amp"]["graph_inputs"].values()}
    assert "model.layers.0.self_attn.q_proj.weight" in names   # the user's parameter names, not dynamo's
    assert any(facts(n).get("module") == "model.layers.1.mlp.down_proj" for n in gm.graph.nodes)
    assert "model.layers.0.self_attn" in str(amp_compiler.explain(gm))
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_greedy_generate_with_a_dynamic_cache_runs_attention_low_and_matches_autocasts_tokens():
    import transformers
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 6))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.autocast("cpu", torch.bfloat16):   # as users call autocast: one region around generate
        expected = model.generate(ids, past_key_values=transformers.DynamicCache(), **settings)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    tokens = model.generate(ids, past_key_values=transformers.DynamicCache(), **settings)
    assert torch.equal(tokens, expected), (tokens, expected)
    decode_graphs = [gm for gm in graphs(model) if gm is not graphs(model)[0]]
    assert decode_graphs, "generate made no decode graph"
    attention = [facts(n).get("precision") for gm in decode_graphs for n in gm.graph.nodes
                 if facts(n).get("family") == "attention" or facts(n).get("op") in ("matmul", "bmm")]
    assert len(attention) >= 2 and all(p == "low" for p in attention), attention   # one per layer at least


class LastLogits(nn.Module):
    """A causal LM head whose forward takes HF's `logits_to_keep: int = 0` (0: every position)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, x, logits_to_keep: int = 0):
        return self.head(torch.relu(self.body(x))[:, -logits_to_keep:, :])


def test_a_forward_with_an_int_keyword_default_keeps_its_output_shape():
    model, x = LastLogits(), torch.randn(2, 5, 16)
    expected_all, expected_last = model(x).shape, model(x, logits_to_keep=1).shape
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    assert model(x).shape == expected_all == (2, 5, 10)
    assert model(x, logits_to_keep=1).shape == expected_last == (2, 1, 10)
    assert all(p == "low" for _, p in matmul_precisions(model))


class TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        inner = 0.7978845608 * (x + 0.044715 * x ** 3)
        tanh = torch.tanh(inner)
        return grad * (0.5 * (1 + tanh) + 0.5 * x * (1 - tanh ** 2) * 0.7978845608 * (1 + 3 * 0.044715 * x ** 2))


class CustomGeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(TanhGelu.apply(self.fc1(x)))


def test_a_model_with_a_custom_autograd_function_converts_and_trains():
    torch.manual_seed(0)
    model, x = CustomGeluMlp(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    out = model(x)
    out.sum().backward()
    precisions = matmul_precisions(model)
    assert len(precisions) >= 2 and all(p == "low" for _, p in precisions), precisions
    assert out.dtype == torch.float32
    torch.testing.assert_close(model.fc1.weight.grad, reference.fc1.weight.grad, atol=0.1, rtol=0.05)


class SignBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.positive, self.negative = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:   # data-dependent: dynamo breaks the graph here
            return self.positive(h)
        return self.negative(h)


def test_a_data_dependent_top_level_breaks_the_graph_and_both_sides_run_low():
    torch.manual_seed(0)
    model = SignBranch()
    x = torch.randn(4, 8)
    sides = [x if model.fc1(x).sum() > 0 else -x]
    sides.append(-sides[0] if model.fc1(-sides[0]).sum() <= 0 else None)
    assert sides[1] is not None, "the test input should reach both sides"
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    for inputs in sides:
        model(inputs)
    modules = {facts(n).get("module") for gm in graphs(model) for n in gm.graph.nodes
               if facts(n).get("family") in MATMUL_FAMILIES}
    assert {"fc1", "positive", "negative"} <= modules, modules
    assert len(graphs(model)) >= 3   # before the break, and one graph per side after it
    assert all(p == "low" for _, p in matmul_precisions(model))


def test_the_inductor_backend_compiles_the_rewritten_graph_within_bf16_tolerance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with torch.no_grad():
        reference = model(x)
        amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="inductor")
        out = model(x)
    torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.02)
    precisions = matmul_precisions(model)
    assert len(precisions) == 2 and all(p == "low" for _, p in precisions), precisions


def test_the_backend_runs_no_input_and_a_second_identical_call_recompiles_nothing():
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).train()
    x = torch.randn(6, 8)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    model(x)
    # A backend that ran the example inputs would have counted a batch on the user's BatchNorm buffer too
    # (and dynamo would fail "Guard failed on the same frame it was created").
    assert model[1].num_batches_tracked.item() == 1
    captured = counters["stats"]["unique_graphs"]
    model(x)
    assert model[1].num_batches_tracked.item() == 2
    assert counters["stats"]["unique_graphs"] == captured and len(graphs(model)) == 1   # no recompile


def test_the_ninth_compiled_model_is_still_compiled():
    # dynamo stops compiling a code object after its recompile limit (8): models must not share one
    models = [nn.Sequential(nn.Linear(8, 8)) for _ in range(10)]
    for model in models:
        amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
        model(torch.randn(2, 8))
    assert [len(graphs(model)) for model in models] == [1] * 10


def test_dynamo_placeholder_and_module_names_read_as_the_users_paths():
    from amp_compiler.dynamo.graph_inputs import name_from_placeholder, user_path
    assert name_from_placeholder("l_self_modules_fc_parameters_weight_") == "fc.weight"
    assert name_from_placeholder("l_module_modules_model_modules_embed_tokens_parameters_weight_") == \
        "model.embed_tokens.weight"
    assert name_from_placeholder("l_args_0_modules_norm_buffers_running_mean_") == "norm.running_mean"
    assert name_from_placeholder("l_input_ids_") is None
    assert user_path("L['module'].model.layers.0.mlp") == "model.layers.0.mlp"
    assert user_path("L['args'][0].encoder") == "encoder" and user_path("L['self']") == ""


def test_a_users_own_torch_compile_of_a_compiled_llm_keeps_mixed_precision_with_its_cache():
    """torch.compile traces Module._call_impl and inlines nested compiled code with its own backend: before, every
    matmul of the converted model ran fp32 under it, silently."""
    import transformers
    model, ids = tiny_llama(), torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        reference = model(ids).logits
        with torch.autocast("cpu", torch.bfloat16):
            autocast_error = (model(ids).logits.float() - reference).abs().max().item()
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    theirs = torch.compile(model)   # the user's, with inductor, on top
    with torch.no_grad():
        out = theirs(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
    assert isinstance(out.past_key_values, transformers.DynamicCache)
    error = (out.logits.float() - reference).abs().max().item()
    assert 0 < error <= 2 * autocast_error, (error, autocast_error)   # 0 would be an fp32 run
    assert graphs(model) and all(p == "low" for _, p in matmul_precisions(model))
    tokens = theirs.generate(ids[:1, :6], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, 10)


def test_restore_gives_the_model_its_own_forward_back():
    import inspect
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    signature = inspect.signature(model.forward)
    expected = model(x)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    assert inspect.signature(model.forward) == signature
    assert not torch.equal(model(x), expected)
    assert amp_compiler.restore(model) is model
    assert "forward" not in model.__dict__ and graphs(model) == []
    assert torch.equal(model(x), expected)
    with pytest.raises(TypeError, match="amp_compiler.compile"):
        amp_compiler.restore(model)


class DataDependent(nn.Module):
    """A graph break: dynamo cannot trace `if y.sum() > 0` into one graph."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.first(x)
        if y.sum() > 0:
            y = y * 2
        return self.second(y)


def test_explain_merges_the_graphs_with_each_graph_break_and_recompile():
    model = DataDependent()
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    assert "not called yet" in str(amp_compiler.explain(model))
    model(torch.randn(2, 8))
    text = str(amp_compiler.explain(model))
    assert "torch.dynamo: 2 graph(s), 1 graph break(s), 0 recompile(s)" in text, text
    assert "graph break: generic_jump" in text and "in forward" in text
    report = amp_compiler.explain(model)
    low = {row["module"] for row in report.rows if row["op"] == "linear" and row["dtype"] == "bfloat16"}
    assert low == {"first", "second"}, low
    model(torch.randn(3, 8))   # a new batch size: dynamo recompiles (dynamic shapes from here on)
    import re
    graphs_made, recompiles = map(int, re.search(r"torch.dynamo: (\d+) graph\(s\), \d+ graph break\(s\), (\d+) "
                                                  r"recompile", str(amp_compiler.explain(model))).groups())
    assert graphs_made == 4 and recompiles >= 1, (graphs_made, recompiles)   # both graphs again, for any batch size


def test_a_graph_the_passes_fail_on_runs_under_autocast_said_once_and_in_explain(monkeypatch):
    import amp_compiler.dynamo.backend as backend
    from amp_compiler.dynamo.backend import ConversionFallbackWarning

    def failing(*args, **kwargs):
        raise RuntimeError("a pass failed on this graph")
    monkeypatch.setattr(backend, "convert_captured_graph", failing)
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    with torch.no_grad():
        fp32 = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            expected = model(x)
        amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
        with pytest.warns(ConversionFallbackWarning, match=r"fc1.*a pass failed.*torch.autocast\(cpu, bfloat16\)"):
            out = model(x)
        torch.testing.assert_close(out, expected)   # autocast decided, not fp32
        assert not torch.equal(out.float(), fp32)
    assert "fallback: the graph of fc1" in str(amp_compiler.explain(model))
