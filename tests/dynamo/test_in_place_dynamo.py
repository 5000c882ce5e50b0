"""convert(model, level, inplace=True): in-place conversion on TorchDynamo's capture, with the cases the retired
parts capture ran as written or got wrong (tests/dynamo/test_dynamo_capture.py covers amp_compiler.compile)."""
import copy

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record
from amp_compiler.passes.node_facts import facts
from test_dynamo_capture import CustomGeluMlp, DataDependent, LastLogits, tiny_llama


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def convert(model, **options):
    return amp_compiler.convert(model, "O1", dtype=torch.bfloat16, inplace=True, capture="dynamo", **options)


def matmul_precisions(model) -> list:
    return [facts(n).get("precision") for gm in graphs(model) for sub in gm.modules()
            if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes
            if facts(n).get("family") in ("matmul", "attention")]


def test_generate_runs_attention_low_in_every_decode_step_with_autocasts_tokens():
    import transformers
    model, ids = tiny_llama(), torch.randint(0, 128, (2, 6))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.autocast("cpu", torch.bfloat16):
        expected = model.generate(ids, **settings)
    assert convert(model) is model
    cache = transformers.DynamicCache()
    tokens = model.generate(ids, past_key_values=cache, **settings)
    assert torch.equal(tokens, expected)
    # the cache is state, not a returned value: kept bf16 as under autocast (restored to fp32 it cost twice the
    # bytes, and every decode step cast all of it back to bf16 for attention)
    assert {layer.keys.dtype for layer in cache.layers} == {layer.values.dtype for layer in cache.layers} == \
        {torch.bfloat16}
    assert all(gm.meta["amp"]["cache_tensors_low"] == 2 * 2 for gm in graphs(model))   # keys, values x 2 layers
    attention = [facts(n).get("precision") for gm in graphs(model)[1:] for n in gm.graph.nodes
                 if facts(n).get("op") == "scaled_dot_product_attention"]
    assert len(attention) >= 2 and set(attention) == {"low"}, attention   # the decode graphs' sdpa, each layer
    assert isinstance(model, transformers.LlamaForCausalLM)


@pytest.mark.parametrize("make", [LastLogits, CustomGeluMlp, DataDependent],
                         ids=["int keyword default", "custom autograd.Function", "data-dependent top level"])
def test_models_the_parts_capture_gets_wrong_or_runs_fp32_convert_with_every_matmul_low(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 5, 16) if make is LastLogits else torch.randn(4, 16 if make is CustomGeluMlp else 8)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            autocast_error = (model(x).float() - reference).abs().max().item()
        convert(model)
        out = model(x)
    assert out.shape == reference.shape
    error = (out.float() - reference).abs().max().item()
    assert error <= 2 * autocast_error + 1e-6, (error, autocast_error)
    precisions = matmul_precisions(model)
    assert len(precisions) >= 2 and set(precisions) == {"low"}, precisions


def test_example_inputs_capture_at_conversion_with_buffers_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    before = model[1].running_mean.clone()
    convert(model, example_inputs=(torch.randn(6, 8),))
    assert graphs(model), "no graph made at conversion"
    assert torch.equal(model[1].running_mean, before)


def test_restore_explain_and_freeze_take_it():
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    expected = model(x)
    convert(model)
    with torch.no_grad():
        model(x)
    assert "torch.dynamo: 1 graph(s)" in str(amp_compiler.explain(model))
    assert amp_compiler.frozen_bytes(model) > 0   # the weight cache is on by default
    assert amp_compiler.freeze(model, sample_values=False) is model   # the cache's option, as freeze's
    assert model.__dict__["_amp_compiled"].converter.weight_cache.sample_values is False
    from amp_compiler.frozen import _packing_available, pack_linears
    packed = graphs(model)[0].meta["amp"]["frozen"]["linears_packed"]
    assert pack_linears(model) is model   # it advised freeze=True: the cache packs bf16 CPU linears already
    assert packed > 0 or not _packing_available()
    amp_compiler.restore(model)
    assert torch.equal(model(x), expected)


def test_it_needs_inplace_and_a_known_capture():
    with pytest.raises(ValueError, match="applies to inplace=True"):
        amp_compiler.convert(CustomGeluMlp(), "O1", capture="dynamo")
    with pytest.raises(ValueError, match="capture must be 'dynamo'; got 'fx'"):
        amp_compiler.convert(CustomGeluMlp(), "O1", inplace=True, capture="fx")
    with pytest.raises(ValueError, match="the parts capture was retired"):
        amp_compiler.convert(CustomGeluMlp(), "O1", inplace=True, capture="parts")
    with pytest.raises(ValueError, match="dynamic_shapes does not apply to inplace=True"):
        amp_compiler.convert(CustomGeluMlp(), "O1", inplace=True, dynamic_shapes={"x": {0: "batch"}})


def test_in_place_is_on_dynamo_by_default_whatever_the_request():
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    assert amp_compiler.convert(model, "O1", inplace=True, dtype=torch.bfloat16) is model
    model(x)
    assert compiled_record(model) is not None
    assert "front end torch.dynamo" in str(amp_compiler.explain(model))
    # what took the parts before: calibration (test_dynamo_calibration), fp8 delayed histories (test_fp8_integrations)
    calibrated = amp_compiler.convert(CustomGeluMlp(), "O1", inplace=True, calibration_data=[(x,)])
    delayed = amp_compiler.convert(CustomGeluMlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_min_dim=16)
    delayed(x)
    for converted in (calibrated, delayed):
        assert compiled_record(converted) is not None and graphs(converted)


def test_a_deepcopy_and_a_torch_save_of_a_converted_model_run_their_own_weights():
    import copy
    import io
    torch.manual_seed(0)
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    convert(model)
    with torch.no_grad():
        model(x)
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for copied in (twin, loaded):
            copied.fc2.weight.mul_(-1.0)   # its own weights: the original must not see this, the copy must
            out = copied(x)
            with torch.autocast("cpu", torch.bfloat16):
                expected = CustomGeluMlp.forward(copied, x)   # as written, the copy's weights
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
            assert graphs(copied) and set(matmul_precisions(copied)) == {"low"}
            assert amp_compiler.explain(copied) is not None
        assert not torch.allclose(model(x), twin(x))


def test_a_call_under_a_users_dispatch_mode_runs_autocast_and_says_so():
    """dynamo runs a frame as written under a TorchDispatchMode: before, every matmul ran fp32, silently."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from amp_compiler.dynamo.compile import DispatchModeFallbackWarning

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
                self.seen.append(args[1].dtype if func.overloadpacket is torch.ops.aten.addmm else args[0].dtype)
            return func(*args, **(kwargs or {}))

    import warnings
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    convert(model)
    with MatmulDtypes() as mode, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        model(x)
    said = [w for w in caught if issubclass(w.category, DispatchModeFallbackWarning)]
    assert len(said) == 1 and "TorchDispatchMode" in str(said[0].message)   # once per model
    assert mode.seen and set(mode.seen) == {torch.bfloat16}, mode.seen


class StringMode(nn.Module):
    """A Python string argument: dynamo makes a graph per value (strings are never dynamic)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mode: str = "a"):
        return self.fc(x) + len(mode)


def test_a_model_recompiled_past_dynamos_default_limit_stays_converted():
    model, x = StringMode(), torch.randn(2, 8)
    convert(model)
    with torch.no_grad():
        for length in range(1, 12):   # dynamo's own limit is 8 graphs per frame, then fp32 as written
            mode = "m" * length
            assert not torch.equal(model(x, mode), model.fc(x) + length), length
    assert len(graphs(model)) == 11


def test_the_last_graph_a_frame_gets_is_said(monkeypatch):
    import sys
    import amp_compiler.dynamo.backend as backend
    from amp_compiler.dynamo.backend import RecompileLimitWarning
    compile_module = sys.modules["amp_compiler.dynamo.compile"]   # the package's `compile` names the function
    monkeypatch.setattr(backend, "RECOMPILE_LIMIT", 3)
    monkeypatch.setitem(compile_module.CAPTURE_SETTINGS, "recompile_limit", 3)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    model, x = StringMode(), torch.randn(2, 8)
    convert(model)
    with torch.no_grad():
        model(x, "a")
        model(x, "bb")
        with pytest.warns(RecompileLimitWarning, match="compiled 3 times.*as written"):
            model(x, "ccc")
        out = model(x, "dddd")   # past the limit: dynamo runs it as written, as the warning said
    assert torch.equal(out, model.fc(x) + 4)


@pytest.mark.parametrize("name", ["nn_lstm", "nn_moe_index_add"])
def test_what_dynamos_defaults_run_as_written_is_converted(name):
    """nn.LSTM is a graph break by default (allow_rnn), and a mask's nonzero in a loop skips the whole frame
    (capture_dynamic_output_shape_ops): both ran fp32 as written with no graph at all."""
    from real_models import REAL_MODELS
    spec = REAL_MODELS[name]
    model = spec.build()
    inputs = spec.inputs()
    with torch.no_grad():
        reference = spec.output(model(*inputs))
        with torch.autocast("cpu", torch.bfloat16):
            autocast_error = (spec.output(model(*inputs)).float() - reference).abs().max().item()
        convert(model)
        error = (spec.output(model(*inputs)).float() - reference).abs().max().item()
    assert graphs(model) and "low" in matmul_precisions(model)
    assert 0 < error <= 2 * autocast_error, (error, autocast_error)


class SkippedByDynamo(nn.Module):
    """A graph break inside a loop: dynamo skips the whole frame (no graph) and runs it as written."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(2):
            x = self.fc(x)
            torch._dynamo.graph_break()
        return x


def test_a_model_dynamo_makes_no_graph_of_runs_under_autocast_after_saying_so():
    from amp_compiler.dynamo.compile import NotCapturedWarning
    model, x = SkippedByDynamo(), torch.randn(2, 8)
    with torch.no_grad():
        expected_fp32 = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            expected_autocast = model(x)
        convert(model)
        with pytest.warns(NotCapturedWarning, match="captured no graph of SkippedByDynamo"):
            first = model(x)
        assert torch.equal(first, expected_fp32)   # that call ran as written: correct, unconverted
        assert torch.equal(model(x), expected_autocast)
    assert "fallback: TorchDynamo captured no graph" in str(amp_compiler.explain(model))


def test_render_draws_every_graph_and_verify_checks_them(tmp_path):
    model, x = DataDependent(), torch.randn(2, 8)
    convert(model)
    model(x)
    path = amp_compiler.render(model, tmp_path / "model.html")
    text = open(path).read()
    assert "first" in text and "second" in text   # both graphs' modules
    amp_compiler.verify(model, x)   # every graph's dtypes as recorded


@pytest.mark.parametrize("separate_reference", [False, True])
def test_compare_replays_every_graph_a_call_runs_and_measures_the_outputs_against_fp32(separate_reference):
    import copy
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(2, 8)
    fp32 = copy.deepcopy(model)
    convert(model)   # compare's own first call captures the graphs (a graph break: two)
    report = amp_compiler.compare(fp32 if separate_reference else model, model, (x,))
    with torch.no_grad():
        expected = (model(x).double() - fp32(x).double()).abs().max().item()
    assert len(report.outputs) == 1 and report.outputs[0].max_abs == pytest.approx(expected) and expected > 0
    assert {e.module for e in report.errors if e.op == "linear"} == {"first", "second"}   # both graphs' linears
    assert {e.node.split(":")[0] for e in report.errors} == {"graph 1", "graph 2"}
    assert report.passed and len(graphs(model)) == 2   # running the model as written recompiled nothing
    strict = amp_compiler.compare(model, model, (x,), rtol=1e-9)
    assert not strict.passed and strict.first_failure.node.startswith("graph 1: ")   # graphs in call order
    assert strict.chain[-1] is strict.first_failure


def test_compare_of_a_llama_on_dynamo_names_its_attention_and_inductor_graphs_are_refused():
    model, ids = tiny_llama(), torch.randint(0, 128, (2, 6))
    convert(model)
    report = amp_compiler.compare(model, model, (ids,))
    assert report.passed, report
    attention = [e for e in report.errors if e.op == "scaled_dot_product_attention"]
    assert {e.module for e in attention} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert {e.dtype for e in attention} == {"bfloat16"}
    compiled = amp_compiler.compile(DataDependent(), "O1", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compare\\(\\) replays graphs run as fx code"):
        amp_compiler.compare(DataDependent(), compiled, (torch.randn(2, 8),))


def test_verify_names_the_graph_whose_dtype_is_not_the_recorded_one():
    from amp_compiler.insight.verify import DtypeMismatch
    model, x = DataDependent(), torch.randn(2, 8)
    convert(model)
    with torch.no_grad():   # verify calls under no_grad: these graphs (grad mode is one of dynamo's guards)
        model(x)
    gm = graphs(model)[-1]
    linear = next(n for n in gm.graph.nodes if facts(n).get("op") == "linear")
    facts(linear)["dtype"] = torch.float32   # the record says fp32; the graph computes bf16
    with pytest.raises(DtypeMismatch, match=f"graph {len(graphs(model))} .*{linear.name}"):
        amp_compiler.verify(model, x)


def test_lora_adapters_added_after_converting_run_low_and_train():
    """peft's get_peft_model on a model converted in place: dynamo captures the adapted forward on its next call
    (the parts capture kept the graphs made before the adapters and ignored them)."""
    peft = pytest.importorskip("peft")
    model, ids = tiny_llama().train(), torch.randint(0, 128, (2, 12))
    convert(model)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapted(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    linears = [(facts(n).get("module") or "", facts(n).get("precision")) for gm in graphs(model)
               for n in gm.graph.nodes if facts(n).get("op") == "linear"]
    lora = [precision for module, precision in linears if ".lora_" in module]
    assert len(lora) == 2 * 2 * 2 and set(lora) == {"low"}, linears   # A and B, q and v, 2 layers
    grads = [p.grad for name, p in adapted.named_parameters() if "lora_B" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_weight_cache_can_be_turned_off():
    model, x = CustomGeluMlp(), torch.randn(3, 16)
    convert(model, weight_cache=False)
    with torch.no_grad():
        model(x)
    assert amp_compiler.frozen_bytes(model) == 0
    from amp_compiler.frozen import pack_linears
    with pytest.raises(TypeError, match="compiled with weight_cache=False"):
        pack_linears(model)
    with pytest.raises(ValueError, match="weight_cache applies to inplace=True"):
        amp_compiler.convert(CustomGeluMlp(), "O1", weight_cache=False)
    with pytest.raises(ValueError, match="freeze=True keeps low weight copies and weight_cache=False keeps none"):
        amp_compiler.convert(CustomGeluMlp(), "O1", inplace=True, freeze=True, weight_cache=False)




@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_batch_norm_running_statistics_train_as_fp32s_do(level, low):
    """The graph reads the buffers as placeholders: a mixed norm kernel cast its running statistics low, so the
    in-place update went to the copies and the model's statistics stayed 0 and 1 (O2 on dynamo, before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).train()
    reference = copy.deepcopy(model)
    amp_compiler.convert(model, level, dtype=low, inplace=True)
    for step in range(3):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step)) + 2
        model(x).float().sum().backward()
        reference(x).sum().backward()
    ours, theirs = model[1], reference[1]
    assert theirs.running_mean.abs().max() > 0.1 and ours.num_batches_tracked == 3
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=0.05, atol=0.02)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0.05, atol=0.02)
