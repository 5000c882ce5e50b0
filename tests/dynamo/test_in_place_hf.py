"""Hugging Face models converted in place keep working as Hugging Face models (issue 20).

GPT-2, Llama, Mistral (grouped-query attention, sdpa) and T5 (encoder-decoder), tiny and random-init, converted
with amp_compiler.convert(model, level, inplace=True) (TorchDynamo's capture: prefill and decode graphs):
  * O0: generate() (KV cache on, greedy and seeded sampling) gives the unconverted model's tokens and scores;
  * O1 bf16/fp16: generate()'s per-step logits, forced along the fp32 model's tokens, are within 2x
    torch.autocast's error on the same steps; at run time the projections and MLP matmuls read low while
    softmax and the norms' math read fp32 (torch.profiler: a TorchDispatchMode makes dynamo fall back);
  * class, methods, config, device, forward signature and state_dict stay; save_pretrained/from_pretrained
    and load_state_dict round trips, the converted model computing with the loaded weights;
  * graphs are made lazily and again for another dtype/keyword; example_inputs makes them at conversion;
  * restore() gives back the fp32 model; training in place reaches every parameter, its matmuls bf16
    forward and backward, gradients within 2x autocast's error; a causal LM called with labels is converted.
T5 (an encoder-decoder): its cross-attention cache, kept bf16 as state, failed dynamo's trace of the next decode step
(an encoder-decoder's cache is kept fp32 now), and generate() ran its encoder through get_encoder() as written, fp32
(the encoder is compiled with the model now).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.compile import compiled_graphs
from amp_compiler.passes.node_facts import facts
from amp_testing import ProfiledDtypes, assert_close_to_fp32, one_torch_thread

pytestmark = pytest.mark.real_models

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
AUTOCAST_SLACK = 2.0
UNIT_ROUNDOFF = {FP16: 2.0 ** -11, BF16: 2.0 ** -8}   # the bound's floor: one rounding of the logits
VOCAB, WIDTH, LAYERS, HEADS = 128, 64, 2, 4
NEW_TOKENS = 4
SPECIAL = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _gpt2():
    config = transformers.GPT2Config(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", **SPECIAL)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      attn_implementation="eager", **SPECIAL)
    return transformers.LlamaForCausalLM(config)


def _mistral():   # grouped-query attention: 2 key/value heads for 4 query heads; sdpa kernels
    config = transformers.MistralConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                        attn_implementation="sdpa", **SPECIAL)
    return transformers.MistralForCausalLM(config)


def _t5():
    config = transformers.T5Config(d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH, num_layers=LAYERS,
                                   num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
                                   attn_implementation="eager", **SPECIAL)
    return transformers.T5ForConditionalGeneration(config)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "t5": _t5}
NAMES = tuple(BUILDERS)
# The math of each model's norms: layer norm kernels, or RMSNorm written as pow/mean/rsqrt.
NORM_OPS = {"gpt2": ("native_layer_norm",), "llama": ("pow", "mean", "rsqrt"), "mistral": ("pow", "mean", "rsqrt"),
            "t5": ("pow", "mean", "rsqrt")}
# Eager attention's softmax. Mistral's sdpa kernel reads bf16 on dynamo's capture, as under autocast (the parts ran
# it fp32): its softmax is inside the kernel, fp32 accumulation
SOFTMAX_OPS = ("_softmax", "_safe_softmax")
# the projections and MLPs: mm/addmm (forward, backward; GPT-2's Conv1D), or in inference the weight cache's
# oneDNN-packed bf16 linear
LINEAR_OPS = ("mm", "addmm", "mkldnn::_linear_pointwise")


@pytest.fixture(autouse=True)
def one_thread():
    with one_torch_thread():   # bit-identical runs; tiny models gain nothing from threads
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(name: str, seed: int = 0):
    """A fresh fp32 model in eval mode: the same weights for the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[name]().eval()


def prompt(batch: int = 2, length: int = 5) -> dict:
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def converted(name: str, level: str, dtype=BF16, **options):
    return amp_compiler.convert(build(name), level, dtype=dtype, inplace=True, **options)


class ForceTokens(LogitsProcessor):
    """Every step picks the token `sequences` has there, so two models' logits are compared on the same steps."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.sequences[:, input_ids.shape[1]:input_ids.shape[1] + 1], 0.0)


def generate(model, sampling: bool = False, along=None, autocast=None):
    """model.generate with the KV cache, seeded; `along`: the sequences to force; `autocast`: a dtype."""
    processors = LogitsProcessorList([ForceTokens(along)] if along is not None else [])
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
        return model.generate(**prompt(), max_new_tokens=NEW_TOKENS, do_sample=sampling, logits_processor=processors,
                              output_scores=True, output_logits=True, return_dict_in_generate=True)


def max_error(steps, reference_steps) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(steps, reference_steps, strict=True))


def assert_within_autocast_error(model, fp32_model, dtype, sampling: bool = False) -> float:
    """The converted model's logits along the fp32 model's tokens vs fp32: at most 2x autocast's error."""
    expected = generate(fp32_model, sampling)
    ours = generate(model, sampling, along=expected.sequences)
    autocast = generate(fp32_model, sampling, along=expected.sequences, autocast=dtype)
    assert torch.equal(ours.sequences, expected.sequences)   # the forcing worked: same steps compared
    scale = max(step.abs().max().item() for step in expected.logits)
    error, autocast_error = max_error(ours.logits, expected.logits), max_error(autocast.logits, expected.logits)
    bound = max(AUTOCAST_SLACK * autocast_error, UNIT_ROUNDOFF[dtype] * scale)
    assert error <= bound, (f"max logit error vs fp32 {error:.3g} > bound {bound:.3g} (autocast's error "
                            f"{autocast_error:.3g}, logit scale {scale:.3g})")
    return error


def matmul_precisions(model) -> list:
    """Every matmul node's precision, but those of modules the model itself keeps fp32 (T5's `wo` in float16:
    its _keep_in_fp32_modules)."""
    return [facts(n).get("precision") for gm in graphs(model) for n in gm.graph.nodes
            if facts(n).get("family") == "matmul" and "_keep_in_fp32_modules" not in facts(n).get("rule", "")]


def assert_projections_ran_low(recorder: ProfiledDtypes) -> None:
    """Every linear (the projections, the MLPs, the LM head) read bf16 inputs only."""
    read = recorder.input_dtypes(*LINEAR_OPS)
    assert read == {BF16}, f"projection matmuls read {sorted(map(str, read))}"


# -- 1. generate ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_o0_generates_the_unconverted_tokens_and_scores_greedy_and_sampled(name):
    fp32_model, model = build(name), converted(name, "O0")
    for sampling in (False, True):
        expected, ours = generate(fp32_model, sampling), generate(model, sampling)
        assert torch.equal(ours.sequences, expected.sequences), f"sampling={sampling}"
        assert all(torch.equal(a, b) for a, b in zip(ours.scores, expected.scores, strict=True)), f"sampling={sampling}"
    assert graphs(model)   # dynamo's graphs ran, not the model as written


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_o1_generate_logits_along_the_fp32_tokens_are_within_twice_autocasts_error(name, dtype):
    fp32_model, model = build(name), converted(name, "O1", dtype)
    for sampling in (False, True):
        assert_within_autocast_error(model, fp32_model, dtype, sampling)
    assert len(graphs(model)) >= 2 and set(matmul_precisions(model)) == {"low"}   # prefill and decode graphs


@pytest.mark.parametrize("name", NAMES)
def test_during_generate_projections_run_low_and_softmax_and_norms_fp32(name):
    model = converted(name, "O1", BF16)
    generate(model)   # dynamo makes the graphs (its tracing's fake ops would show in the profile)
    made = len(graphs(model))
    with ProfiledDtypes() as recorder:
        generate(model)
    assert len(graphs(model)) == made   # the profiled call compiled nothing
    assert_projections_ran_low(recorder)
    if name != "mistral":   # sdpa: one bf16 kernel (SOFTMAX_OPS)
        softmax = recorder.input_dtypes(*SOFTMAX_OPS)
        assert softmax == {FP32}, f"softmax read {softmax}"
    for op in NORM_OPS[name]:
        assert recorder.input_dtypes(op) == {FP32}, f"{op} (norm math) read {recorder.input_dtypes(op)}"


def test_an_encoder_decoder_runs_its_encoder_low_from_the_first_generate():
    """generate() calls model.get_encoder() itself, before any forward of the model: the encoder is compiled with
    the model, so it runs low from the first generate (the call generate makes is profiled here)."""
    model = converted("t5", "O1", BF16)
    with torch.no_grad():
        model.get_encoder()(**prompt())   # the call generate makes first: it makes the encoder's graph
    assert [path for path, _, _ in compiled_graphs(model)] == ["encoder"]   # listed under the model
    with torch.no_grad(), ProfiledDtypes() as recorder:   # profiled once the graph exists (not dynamo's tracing)
        model.get_encoder()(**prompt())
    assert_projections_ran_low(recorder)
    assert "encoder" in {row["module"].split(".")[0] for row in amp_compiler.explain(model).rows}
    amp_compiler.restore(model)
    assert "forward" not in model.get_encoder().__dict__   # restore puts the encoder's forward back too


# -- 2. what the user keeps ----------------------------------------------------------------------------------
def state(model) -> dict:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def assert_same_state(state_dict: dict, expected: dict) -> None:
    assert state_dict.keys() == expected.keys()
    changed = [key for key, value in expected.items()
               if state_dict[key].dtype != value.dtype or not torch.equal(state_dict[key], value)]
    assert not changed, f"state_dict entries changed: {changed[:5]}"


@pytest.mark.parametrize("name", NAMES)
def test_class_methods_config_signature_state_dict_and_checkpoints_stay_hugging_faces(name, tmp_path):
    model = build(name)
    cls, config, signature, modules, before = (type(model), model.config, inspect.signature(model.forward),
                                                [path for path, _ in model.named_modules()], state(model))
    assert amp_compiler.convert(model, "O1", dtype=BF16, inplace=True) is model
    generate(model)   # dynamo's graphs
    assert graphs(model)
    assert type(model) is cls and model.config is config and model.device == torch.device("cpu")
    assert model.generate.__func__ is cls.generate and model.save_pretrained.__func__ is cls.save_pretrained
    assert inspect.signature(model.forward) == signature
    assert [path for path, _ in model.named_modules()] == modules   # nothing registered on the model
    assert_same_state(state(model), before)

    model.save_pretrained(tmp_path)   # a plain Hugging Face checkpoint: an unconverted model loads it
    loaded = cls.from_pretrained(tmp_path)
    assert compiled_record(loaded) is None and type(loaded.forward).__name__ == "method"
    assert_same_state(state(loaded), before)

    other = build(name, seed=1)   # an unconverted checkpoint loads into the converted model ...
    model.load_state_dict(other.state_dict())
    assert_same_state(state(model), state(other))
    assert_within_autocast_error(model, other, BF16)   # ... and its graphs compute with those weights


# -- 3. lazy capture, recapture --------------------------------------------------------------------------------
def test_graphs_are_made_lazily_and_again_for_another_dtype_or_keyword():
    fp32_model, model = build("llama"), converted("llama", "O1")
    assert not graphs(model)   # no example inputs needed: graphs are made on calls
    ids = prompt()["input_ids"]
    calls = [((ids,), {"use_cache": False}),                  # tensors and constants only
             ((ids[:1, :3],), {"use_cache": False}),          # another shape
             ((ids.int(),), {"use_cache": False}),            # another dtype: a graph of its own
             ((ids,), {"use_cache": False, "attention_mask": torch.ones_like(ids)})]   # a keyword: again
    made = []
    with torch.no_grad():
        for args, kwargs in calls:
            output = model(*args, **kwargs).logits
            assert_close_to_fp32(output, fp32_model(*args, **kwargs).logits, BF16)
            made.append(len(graphs(model)))
    assert made[0] >= 1 and made[1] >= made[0] and made[3] > made[2] > made[1], made
    assert set(matmul_precisions(model)) == {"low"}


def test_example_inputs_capture_at_conversion():
    ids = prompt()["input_ids"]
    model = converted("llama", "O1", example_inputs=(ids,))
    assert graphs(model), "no graph after convert(example_inputs=...)"
    count = len(graphs(model))
    with torch.no_grad():
        model(ids)   # the call the example made: its graph is reused
    assert len(graphs(model)) == count


# -- 4. restore ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_restore_gives_back_the_fp32_model(name):
    fp32_model, model = build(name), converted(name, "O1")
    generate(model)
    assert amp_compiler.restore(model) is model and compiled_record(model) is None
    assert not [path for path, module in model.named_modules() if "forward" in module.__dict__]
    for sampling in (False, True):
        expected, ours = generate(fp32_model, sampling), generate(model, sampling)
        assert torch.equal(ours.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(ours.logits, expected.logits, strict=True))


# -- 5. training in place --------------------------------------------------------------------------------------
def gradients(model, ids, autocast=None) -> dict:
    with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    named = dict(model.named_parameters())
    return dict(zip(named, torch.autograd.grad(loss, list(named.values()))))


def relative_error(grads: dict, reference: dict) -> float:
    difference = torch.cat([(grads[name].double() - reference[name].double()).flatten() for name in reference])
    return (difference.norm() / torch.cat([g.double().flatten() for g in reference.values()]).norm()).item()


# Mistral trains like Llama; T5's train-mode graphs take seconds of CPU
@pytest.mark.parametrize("name", ["gpt2", "llama", pytest.param("t5", marks=pytest.mark.slow)])
def test_training_in_place_reaches_every_parameter_close_to_fp32(name):
    fp32_model, model = build(name).train(), converted(name, "O1").train()
    ids = prompt()["input_ids"]
    expected, autocast = gradients(fp32_model, ids), gradients(fp32_model, ids, autocast=BF16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids)   # dynamo makes the graph (its tracing's fake ops would show in the profile)
    made = len(graphs(model))
    with ProfiledDtypes() as recorder:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert len(graphs(model)) == made   # the profiled call compiled nothing
    assert_projections_ran_low(recorder)   # forward and backward: not the fp32 model run as written
    grads = dict(model.named_parameters())
    missing = [path for path, p in grads.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reached {missing[:5]}"
    grads = {path: p.grad for path, p in grads.items()}
    error, autocast_error = relative_error(grads, expected), relative_error(autocast, expected)
    assert error <= max(AUTOCAST_SLACK * autocast_error, UNIT_ROUNDOFF[BF16]), \
        f"gradient error vs fp32 {error:.3g} (relative norm), autocast's {autocast_error:.3g}"
    before = state(model)
    optimizer.step()
    assert not [key for key, value in model.state_dict().items() if torch.equal(value, before[key])]
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss < loss   # the step went downhill


# A ModelOutput field read behind an opaque call was classified as metadata (no cast: a dtype error), and the
# DynamicCache was registered for torch.export only when the captured module itself was the HF model.
def test_a_causal_lm_called_with_labels_is_one_working_graph():
    model = converted("llama", "O1")
    ids = prompt()["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    assert len(graphs(model)) == 1, amp_compiler.explain(model).summary["frontend"]
    assert set(matmul_precisions(model)) == {"low"}
    as_written = type(model).forward(model, input_ids=ids, labels=ids).loss   # the class's forward: fp32
    assert torch.allclose(loss, as_written, rtol=0.01)
