"""explain() on what wraps or hides a conversion (issue 29): a model that runs as one opaque call (nothing
converted, and why, in the opening lines), and a peft PeftModel whose inner model is converted."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import amp_compiler
from amp_compiler.insight.report import converted_model_in


class Codec(nn.Module):
    """An audio codec: weight-normed convolutions, an LSTM, and a loudness normalisation that reads a value."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = weight_norm(nn.Conv1d(1, 16, 7, padding=3))
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.decode = weight_norm(nn.Conv1d(16, 1, 7, padding=3))

    def forward(self, x):
        scale = x.abs().amax()
        if scale > 0:
            x = x / scale
        h = torch.relu(self.encode(x))
        y, _ = self.lstm(h.transpose(1, 2))
        return self.decode(y.transpose(1, 2) + h) * scale


class CodecModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.codec = Codec()

    def forward(self, x):
        return self.codec(x)


def _opening(report) -> str:
    return " ".join(line.strip() for line in report.summary_lines()[:5])


def test_a_model_that_runs_as_one_opaque_call_says_nothing_was_converted_and_why():
    torch.manual_seed(0)
    gm = amp_compiler.convert(CodecModel().eval(), "O1")
    report = amp_compiler.explain(gm)
    assert report.totals["nodes_per_dtype"].get("float16", 0) == 0
    second = report.summary_lines()[1]
    assert second.startswith("nothing converted: 0 nodes run float16"), report.summary_lines()   # before: "nodes: ..."
    opening = _opening(report)
    assert "one opaque call (codec)" in opening and "torch.autocast(float16)" in opening
    assert "torch.fx cannot trace it" in opening and "if scale > 0" in opening   # the front end's reason


def test_the_codec_traced_whole_converts_and_says_nothing_of_the_kind():
    """The same layers without the value-reading branch: weight-normed convs and the LSTM run low."""
    class Traceable(Codec):
        def forward(self, x):
            h = torch.relu(self.encode(x))
            y, _ = self.lstm(h.transpose(1, 2))
            return self.decode(y.transpose(1, 2) + h)

    report = amp_compiler.explain(amp_compiler.convert(Traceable().eval(), "O1"))
    assert report.totals["nodes_per_dtype"]["float16"] > 0
    assert not any(line.startswith("nothing converted") for line in report.summary_lines())


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


class BaseModel(nn.Module):   # the shape of peft's wrappers: PeftModel.base_model (a LoraModel) .model
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class Wrapper(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = BaseModel(model)

    def forward(self, *args):
        return self.base_model.model(*args)


def test_explain_finds_the_converted_model_inside_a_wrapper_of_peft_shape():
    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(2, 8)
    amp_compiler.convert(model, "O1", inplace=True)
    wrapped = Wrapper(model)
    wrapped(x)
    assert amp_compiler.explain(wrapped).totals == amp_compiler.explain(model).totals
    assert converted_model_in(wrapped) is model
    with pytest.raises(ValueError, match="needs a GraphModule"):   # nothing converted inside: still refused
        amp_compiler.explain(Wrapper(TwoLayers()))


def test_explain_of_a_peft_model_whose_inner_model_is_converted():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(2, 8)
    amp_compiler.convert(model, "O1", inplace=True)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["fc"]))
    adapted(x)
    report = amp_compiler.explain(adapted)      # before: "PeftModel: needs a GraphModule returned by convert()"
    assert report.summary["in_place"] and report.totals["nodes_per_dtype"]["float16"] >= 2
    assert any(row["module"].startswith("fc.lora_A") for row in report.rows)
    assert not report.warnings


def test_explain_of_peft_adapters_put_into_a_converted_graph_says_they_never_run():
    """get_peft_model(convert(model)): the graph reads fc.weight itself, so the LoRA layer's forward never runs."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base, x = TwoLayers(), torch.randn(2, 8)
    adapted = peft.get_peft_model(amp_compiler.convert(base, "O1"), peft.LoraConfig(r=2, target_modules=["fc"]))
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param)
    assert torch.allclose(adapted(x).float(), base(x), atol=1e-2)   # the adapter made no difference
    warnings = amp_compiler.explain(adapted).warnings
    assert len(warnings) == 1 and warnings[0].startswith("fc became peft.tuners.lora") and "never runs" in warnings[0]
