"""A model whose own forward cannot be captured runs as written with its children converted, each with the call it got.

A child called with keywords (`self.encoder(input_ids=ids, attention_mask=mask)`, as HF heads call their
bodies) got no example inputs: fx could not trace BertModel without them, so the whole encoder ran as written in
fp32 and only the head ran low. The call is put in positional form now: example_inputs=(ids, mask).
"""
from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import amp_compiler
from amp_compiler.frontend.example_inputs import positional_inputs
from amp_testing import AtenDtypeRecorder, assert_close_to_fp32

MATMULS = ("mm", "addmm", "bmm", "baddbmm")


class GuardedClassifier(nn.Module):
    """Data-dependent Python at the top level (neither front end captures it), an HF encoder called by keyword."""

    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32)
        config._attn_implementation = "eager"
        self.encoder = transformers.BertModel(config)
        self.head = nn.Linear(32, 3)

    def forward(self, input_ids, attention_mask):
        if int(attention_mask.sum(1).min()) == 0:
            raise ValueError("a sequence without tokens")
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return self.head(out.last_hidden_state[:, 0])


def _inputs():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0
    return ids, mask


def test_a_child_called_with_keywords_is_converted_with_that_call():
    torch.manual_seed(0)
    model, inputs = GuardedClassifier().eval(), _inputs()
    converted = amp_compiler.convert(model, "O1", example_inputs=inputs)
    assert set(converted.meta["amp"]["children"]) == {"encoder", "head"}   # was {"head"}
    with AtenDtypeRecorder() as recorder:
        out = converted(*inputs)
    matmuls = [dtypes for name in MATMULS for dtypes in recorder.calls.get(name, [])]
    assert len(matmuls) >= 12 and all(set(dtypes) == {torch.float16} for dtypes in matmuls)   # was fp32 but 1
    assert_close_to_fp32(out, model(*inputs), torch.float16)


class Block(nn.Module):
    def forward(self, x, mask=None, scale: float = 1.0, *, gate=None, **extra):
        return x


@pytest.mark.parametrize("call, expected", [
    (((1,), {}), (1,)),
    (((), {"x": 1, "mask": 2}), (1, 2)),
    (((1,), {"scale": 3.0}), (1, None, 3.0)),   # the default in the gap
    (((1,), {"gate": 2}), None),                # keyword-only: no positional form
    (((1,), {"other": 2}), None),               # taken by **extra
])
def test_a_call_with_keywords_in_positional_form(call, expected):
    args, kwargs = call
    assert positional_inputs(Block(), args, kwargs) == expected
