"""Hugging Face models converted in place keep working as Hugging Face models (issue 20).

GPT-2, Llama, Mistral (grouped-query attention, sdpa) and T5 (encoder-decoder), tiny and random-init, converted
with amp_compiler.convert(model, level, inplace=True):
  * O0: generate() (KV cache on, greedy and seeded sampling) gives the unconverted model's tokens and scores;
  * O1 bf16/fp16: generate()'s per-step logits, forced along the fp32 model's tokens, are within 2x
    torch.autocast's error on the same steps; at run time the projections and MLP matmuls read low while
    softmax and the norms' math read fp32 (TorchDispatchMode);
  * class, methods, config, device, forward signature and state_dict stay; save_pretrained/from_pretrained
    and load_state_dict round trips, the converted model computing with the loaded weights;
  * parts capture lazily and again for another dtype/rank/keyword; example_inputs captures at conversion;
    parts taking a cache run as written with their reason, their children converted;
  * restore() gives back the fp32 model; training in place reaches every parameter, close to fp32.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

import amp_compiler
from amp_compiler.in_place import in_place_conversion
from amp_testing import AtenDtypeRecorder

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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # bit-identical runs; tiny models gain nothing from threads
    yield
    torch.set_num_threads(threads)


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


def parts(model):
    return in_place_conversion(model).parts


def total_captures(model) -> int:
    return sum(part.captures for part in parts(model).values())


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
    matmuls = recorder.calls["mm"] + recorder.calls["addmm"]
    assert matmuls and all(set(dtypes) == {BF16} for dtypes in matmuls), \
        f"projection matmuls read {sorted(map(str, {d for dtypes in matmuls for d in dtypes}))}"
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
