"""Hugging Face models converted in place keep working as Hugging Face models (issue 20).

GPT-2, Llama, Mistral (grouped-query attention, sdpa) and T5 (encoder-decoder), tiny and random-init, converted
with amp_compiler.convert(model, level, inplace=True, capture="parts"):
  * O0: generate() (KV cache on, greedy and seeded sampling) gives the unconverted model's tokens and scores;
  * O1 bf16/fp16: generate()'s per-step logits, forced along the fp32 model's tokens, are within 2x
    torch.autocast's error on the same steps; at run time the projections and MLP matmuls read low while
    softmax and the norms' math read fp32 (TorchDispatchMode);
  * class, methods, config, device, forward signature and state_dict stay; save_pretrained/from_pretrained
    and load_state_dict round trips, the converted model computing with the loaded weights;
  * parts capture lazily and again for another dtype/rank/keyword; example_inputs captures at conversion;
    parts taking a cache run as written with their reason, their children converted;
  * restore() gives back the fp32 model; training in place reaches every parameter, its matmuls bf16
    forward and backward, gradients within 2x autocast's error (a causal LM called with labels: see the
    xfail at the end, a convert() bug; in place the top level runs as written, its children converted).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

import amp_compiler
from amp_compiler.in_place import in_place_conversion
from amp_testing import AtenDtypeRecorder, assert_close_to_fp32, one_torch_thread

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
SOFTMAX_OPS = ("_softmax", "_safe_softmax", "_scaled_dot_product_flash_attention_for_cpu")


@pytest.fixture(autouse=True)
def one_thread():
    with one_torch_thread():   # bit-identical runs; tiny models gain nothing from threads
        yield


def build(name: str, seed: int = 0):
    """A fresh fp32 model in eval mode: the same weights for the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[name]().eval()


def prompt(batch: int = 2, length: int = 5) -> dict:
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def converted(name: str, level: str, dtype=BF16, **options):
    return amp_compiler.convert(build(name), level, dtype=dtype, inplace=True, capture="parts", **options)


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


def parts(model):
    return in_place_conversion(model).parts


def total_captures(model) -> int:
    return sum(part.captures for part in parts(model).values())


def assert_projections_ran_low(recorder: AtenDtypeRecorder) -> None:
    """Every mm/addmm (the projections, the MLPs, the LM head) read bf16 inputs only."""
    matmuls = recorder.calls["mm"] + recorder.calls["addmm"]
    assert matmuls and all(set(dtypes) == {BF16} for dtypes in matmuls), \
        f"projection matmuls read {sorted(map(str, {d for dtypes in matmuls for d in dtypes}))}"


# -- 1. generate ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_o0_generates_the_unconverted_tokens_and_scores_greedy_and_sampled(name):
    fp32_model, model = build(name), converted(name, "O0")
    for sampling in (False, True):
        expected, ours = generate(fp32_model, sampling), generate(model, sampling)
        assert torch.equal(ours.sequences, expected.sequences), f"sampling={sampling}"
        assert all(torch.equal(a, b) for a, b in zip(ours.scores, expected.scores, strict=True)), f"sampling={sampling}"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_o1_generate_logits_along_the_fp32_tokens_are_within_twice_autocasts_error(name, dtype):
    fp32_model, model = build(name), converted(name, "O1", dtype)
    for sampling in (False, True):
        assert_within_autocast_error(model, fp32_model, dtype, sampling)


@pytest.mark.parametrize("name", NAMES)
def test_during_generate_projections_run_low_and_softmax_and_norms_fp32(name):
    model = converted(name, "O1", BF16)
    generate(model)   # the parts capture (a capture's fake propagation would show in the recorder as fp32 ops)
    with AtenDtypeRecorder() as recorder:
        generate(model)
    assert_projections_ran_low(recorder)
    softmax = recorder.input_dtypes(*SOFTMAX_OPS)
    assert softmax == {FP32}, f"softmax/attention read {softmax}"
    for op in NORM_OPS[name]:
        assert recorder.input_dtypes(op) == {FP32}, f"{op} (norm math) read {recorder.input_dtypes(op)}"


def test_an_encoder_decoder_runs_its_encoder_low_from_the_first_generate():
    """generate() calls model.get_encoder() itself, before any forward of the model: the encoder is a part
    from the conversion on, so the first generate already runs it as a graph (it ran fp32 as written before)."""
    model = converted("t5", "O1", BF16)
    assert set(parts(model)) == {"", "encoder"} and parts(model)["encoder"].captures == 0
    generate(model)
    encoder = parts(model)["encoder"]
    assert encoder.captures == 1 and len(encoder.graphs) == 1 and not encoder.as_written


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
    assert amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts") is model
    generate(model)   # the parts capture
    assert type(model) is cls and model.config is config and model.device == torch.device("cpu")
    assert model.generate.__func__ is cls.generate and model.save_pretrained.__func__ is cls.save_pretrained
    assert inspect.signature(model.forward) == signature
    assert [path for path, _ in model.named_modules()] == modules   # nothing registered on the model
    assert_same_state(state(model), before)

    model.save_pretrained(tmp_path)   # a plain Hugging Face checkpoint: an unconverted model loads it
    loaded = cls.from_pretrained(tmp_path)
    assert in_place_conversion(loaded) is None and type(loaded.forward).__name__ == "method"
    assert_same_state(state(loaded), before)

    other = build(name, seed=1)   # an unconverted checkpoint loads into the converted model ...
    model.load_state_dict(other.state_dict())
    assert_same_state(state(model), state(other))
    assert_within_autocast_error(model, other, BF16)   # ... and its graphs compute with those weights


# -- 3. lazy capture, recapture, as-written parts --------------------------------------------------------------
def test_parts_capture_lazily_and_again_for_another_dtype_or_keyword():
    fp32_model, model = build("llama"), converted("llama", "O1")
    root = parts(model)[""]
    assert list(parts(model)) == [""] and root.captures == 0 and not root.graphs   # no example inputs needed
    ids = prompt()["input_ids"]
    calls = [((ids,), {"use_cache": False}),                  # tensors and constants only: one graph
             ((ids[:1, :3],), {"use_cache": False}),          # another shape: the same graph
             ((ids.int(),), {"use_cache": False}),            # another dtype: captured again
             ((ids,), {"use_cache": False, "attention_mask": torch.ones_like(ids)})]   # a keyword: again
    captures = []
    with torch.no_grad():
        for args, kwargs in calls:
            output = model(*args, **kwargs).logits
            assert_close_to_fp32(output, fp32_model(*args, **kwargs).logits, BF16)
            captures.append(root.captures)
    assert captures == [1, 1, 2, 3] and len(root.graphs) == 3 and not root.as_written


def test_example_inputs_capture_at_conversion():
    ids = prompt()["input_ids"]
    model = converted("llama", "O1", example_inputs=(ids,))
    captured = [path for path, part in parts(model).items() if part.graphs]
    assert captured, "no part has a graph after convert(example_inputs=...)"
    count = total_captures(model)
    with torch.no_grad():
        model(ids)   # the call the example made: every part finds its graph or its as-written key
    assert total_captures(model) == count


# name -> (the cache's class, parts that get it and run as written, parts below them that are graphs)
CACHE_TAKERS = {
    "llama": ("DynamicCache", ("", "model", "model.layers.0", "model.layers.1.self_attn"),
              ("lm_head", "model.layers.0.mlp", "model.layers.1.self_attn.q_proj")),
    "t5": ("EncoderDecoderCache", ("", "decoder", "decoder.block.0", "decoder.block.1.layer.1.EncDecAttention"),
           ("lm_head", "encoder", "decoder.block.0.layer.2", "decoder.block.1.layer.0.SelfAttention.q")),
}


@pytest.mark.parametrize("name", CACHE_TAKERS)
def test_parts_given_a_cache_run_as_written_with_the_reason_and_their_children_are_graphs(name):
    cache, as_written, graphs = CACHE_TAKERS[name]
    model = converted(name, "O1")
    generate(model)
    found = parts(model)
    for path in as_written:
        reasons = list(found[path].as_written.values())
        assert not found[path].graphs and reasons and all(cache in reason for reason in reasons), (path, reasons)
    for path in graphs:
        assert found[path].graphs and not found[path].as_written, path
    lm_head = found["lm_head"]
    captures = lm_head.captures
    with torch.no_grad():   # a rank the part has not seen: captured again
        model.lm_head(torch.randn(3, WIDTH))
    assert lm_head.captures == captures + 1 and len(lm_head.graphs) == 2


# -- 4. restore ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_restore_gives_back_the_fp32_model(name):
    fp32_model, model = build(name), converted(name, "O1")
    generate(model)
    assert amp_compiler.restore(model) is model and in_place_conversion(model) is None
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


# Mistral trains like Llama; T5's train-mode captures take ~11 s of CPU
@pytest.mark.parametrize("name", ["gpt2", "llama", pytest.param("t5", marks=pytest.mark.slow)])
def test_training_in_place_reaches_every_parameter_close_to_fp32(name):
    fp32_model, model = build(name).train(), converted(name, "O1").train()
    ids = prompt()["input_ids"]
    expected, autocast = gradients(fp32_model, ids), gradients(fp32_model, ids, autocast=BF16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids)   # the parts capture (a capture's fake propagation would show as fp32 ops)
    with AtenDtypeRecorder() as recorder:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
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
    root = parts(model)[""]
    assert root.graphs, f"the top level runs as written: {list(root.as_written.values())}"
    as_written = type(model).forward(model, input_ids=ids, labels=ids).loss   # the class's forward: fp32
    assert torch.allclose(loss, as_written, rtol=0.01)
