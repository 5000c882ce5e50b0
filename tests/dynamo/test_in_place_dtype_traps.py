"""Dtype traps after converting (issue 29): model.half() / .to(bfloat16) after convert(..., inplace=True), and
Apex O2's save_pretrained recording the fp16 parameters' dtype for fp32 weights."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NormedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)).softmax(-1))


def _calls_warning(model, x, calls: int = 3) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            model(x)
    return [str(w.message) for w in caught if "float()" in str(w.message)]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["half", "to_bf16"])
def test_making_an_in_place_converted_model_low_says_call_float_once(low):
    """Before: every later capture refused the low parameters, swallowed, and the model ran plain low with no word."""
    torch.manual_seed(0)
    model, x = NormedHead().eval(), torch.randn(2, 8)
    amp_compiler.convert(model, "O1", dtype=torch.bfloat16, inplace=True)
    assert _calls_warning(model, x) == [] and graphs(model)
    model.half() if low == torch.float16 else model.to(low)
    said = _calls_warning(model, x.to(low))
    assert len(said) == 1, said
    assert f"NormedHead has {low} parameters" in said[0] and "Call model.float() first" in said[0]
    assert "after convert(..., inplace=True)" in said[0]
    with pytest.raises(ValueError, match="Call model.float"):   # what convert() already says of such a model
        amp_compiler.convert(NormedHead().to(low), "O1", inplace=True)


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_a_graph_that_still_runs_on_the_low_weights_says_it_too():
    """The same fp32 call after .half(): before, silent. (On the parts, the graph captured before ran on the low
    weights; dynamo guards on the weights' dtype and makes a graph on them: either way the call runs and must say.)"""
    torch.manual_seed(0)
    model, x = Projection().eval(), torch.randn(2, 8)
    amp_compiler.convert(model, "O1", inplace=True)
    model(x)
    assert len(graphs(model)) == 1
    model.half()
    said = _calls_warning(model, x)
    assert len(said) == 1 and "Projection has torch.float16 parameters" in said[0], said


def test_apex_initialize_keeps_working_without_the_warning():
    """Apex's O2 casts the weights low on purpose: no warning."""
    torch.manual_seed(0)
    model = NormedHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_compiler.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert _calls_warning(model, torch.randn(2, 8)) == []


def test_apex_o2_save_pretrained_records_the_dtype_of_the_saved_weights(tmp_path):
    """The weights file holds the fp32 masters; config.json said "float16" (the fp16 parameters'), so a plain
    from_pretrained rounded them to fp16."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = transformers.BertForSequenceClassification(config)
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_compiler.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert model.dtype == torch.float16
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert {value.dtype for value in saved.values()} == {torch.float32}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    weight = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(dict(loaded.named_parameters())[weight], masters[weight])   # not rounded to fp16
