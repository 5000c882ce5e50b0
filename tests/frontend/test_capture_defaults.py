"""Python values a forward takes (an int, a float, None, a string) are constants of the fx graph, never inputs.

HF causal LMs take `logits_to_keep: int = 0` and slice `hidden[:, slice(-k, None) if isinstance(k, int) else k]`:
traced as a placeholder the int was a Proxy, the graph indexed with it, and the logits came out (2, V) for
(2, T, V); the int was cast to bfloat16 too.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

import amp_compiler
from amp_testing import assert_close_to_fp32


class KeepLast(nn.Module):
    """The 8 lines that reproduce it: an int default that picks positions, as HF's causal LMs do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, keep: int = 0):
        positions = slice(-keep, None) if isinstance(keep, int) else keep
        return self.fc(x)[:, positions, :]


def _uses_of(gm, name: str) -> list[str]:
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name)
    return sorted(str(user.target) for user in placeholder.users)


@pytest.mark.parametrize("example", [False, True], ids=["no_example_inputs", "example_inputs"])
def test_int_default_that_picks_positions_is_baked_in_not_a_graph_input(example):
    model, x = KeepLast().eval(), torch.randn(2, 5, 8)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,) if example else None)
    assert gm.meta["amp"]["frontend"] == "fx.symbolic_trace"
    assert gm(x).shape == model(x).shape == (2, 5, 8)
    assert_close_to_fp32(gm(x), model(x), torch.bfloat16)
    assert "amp_cast" not in " ".join(_uses_of(gm, "keep"))   # only the check of its value reads it
    assert gm(x, keep=0).shape == (2, 5, 8)                    # the baked value, by keyword, is accepted
    with pytest.raises(AssertionError, match=r"keep=0 baked in .* convert again with that value in example_inputs"):
        gm(x, keep=2)                                          # another value is never silently ignored


def test_an_int_given_in_example_inputs_is_baked_in_with_that_value():
    model, x = KeepLast().eval(), torch.randn(2, 5, 8)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x, 2))
    assert gm(x, 2).shape == model(x, 2).shape == (2, 2, 8)
    with pytest.raises(AssertionError, match="keep=2 baked in"):
        gm(x, 3)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale: float = 2.0):
        y = self.fc(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


def test_a_baked_argument_keeps_its_name_and_fake_values_propagate():
    model, x = OptionalMask().eval(), torch.randn(2, 4)
    gm = amp_compiler.convert(model, "O1", example_inputs=(x,))
    assert_close_to_fp32(gm(x, mask=None, scale=2.0), model(x), torch.float16)   # was: unexpected keyword 'mask'
    assert gm.meta["amp"]["pass_counts"]["propagate_values"]["values_propagated"] > 0   # was 0: 3 inputs, 1 value
    with pytest.raises(AssertionError, match="scale=2.0 baked in"):
        gm(x, scale=3.0)


@dataclasses.dataclass
class Output(transformers.utils.ModelOutput):
    logits: torch.Tensor = None
    hidden: torch.Tensor = None


class ModelOutputWithDefaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, return_hidden: bool = True):
        h = self.fc(x)
        return Output(logits=h.softmax(-1), hidden=h if return_hidden else None)


def test_a_model_output_returned_by_a_forward_with_defaults_keeps_its_type():
    model, x = ModelOutputWithDefaults().eval(), torch.randn(2, 4)
    gm = amp_compiler.convert(model, "O1")   # was a SyntaxError at recompile: `x, mask = None, = ...`
    out = gm(x)
    assert type(out) is Output and out.hidden.shape == (2, 4)
    assert_close_to_fp32(out.logits, model(x).logits, torch.float16)


class CausalLMWrapper(nn.Module):
    """A model calling an HF causal LM as most user code does: without logits_to_keep."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, logits_to_keep: int = 0):
        return self.lm(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)


_TINY_LM = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, use_cache=False)


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_hf_causal_lm_logits_keep_their_shape_and_output_type(family):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**_TINY_LM)
    model = CausalLMWrapper(getattr(transformers, f"{family}ForCausalLM")(config)).eval()
    ids = torch.randint(0, 64, (2, 8))
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16)   # fx traces the top level
    out, expected = gm(ids), model(ids)
    assert type(out) is type(expected) and out.logits.shape == expected.logits.shape == (2, 8, 64)
    with torch.autocast("cpu", torch.bfloat16):
        autocast_error = (model(ids).logits.float() - expected.logits).abs().max().item()
    assert (out.logits.float() - expected.logits).abs().max().item() <= 2 * autocast_error + 1e-6
