"""The fx front end returns the model's own output container when the forward takes *args or **kwargs too
(transformers' models take **kwargs; it returned a plain dict there, so `out.logits` raised), and after
torch.save / torch.load (fx rebuilds a loaded module by tracing its saved code)."""
import collections

import pytest
import torch
from torch import nn

import amp_compiler

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention  # noqa: E402

Pair = collections.namedtuple("Pair", "logits hidden")


class WithKwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels=None, **kwargs):
        return ImageClassifierOutputWithNoAttention(logits=self.fc(x))


class WithArgs(WithKwargs):
    def forward(self, *inputs):
        return ImageClassifierOutputWithNoAttention(logits=self.fc(inputs[0]))


@pytest.mark.parametrize("model_class", [WithKwargs, WithArgs])
def test_a_model_output_comes_back_from_a_forward_with_variadic_parameters(model_class):
    torch.manual_seed(0)
    model, x = model_class().eval(), torch.randn(2, 8)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    out = gm(x)
    assert type(out) is ImageClassifierOutputWithNoAttention
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 4)
    torch.testing.assert_close(out.logits, model(x).logits, atol=2e-2, rtol=2e-2)


def test_keywords_still_reach_a_forward_with_kwargs():
    model, x = WithKwargs().eval(), torch.randn(2, 8)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    assert type(gm(x=x)) is ImageClassifierOutputWithNoAttention
    assert type(gm(x, output_attentions=False)) is ImageClassifierOutputWithNoAttention


class Plain(WithKwargs):
    def forward(self, x):
        return ImageClassifierOutputWithNoAttention(logits=self.fc(x))


@pytest.mark.parametrize("model_class", [Plain, WithKwargs])
def test_a_model_output_survives_torch_save_and_load(model_class, tmp_path):
    """fx rebuilds a loaded GraphModule by tracing its saved code, which turned the ModelOutput into a dict."""
    model, x = model_class().eval(), torch.randn(2, 8)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    expected = gm(x).logits
    torch.save(gm, tmp_path / "gm.pt")
    out = torch.load(tmp_path / "gm.pt", weights_only=False)(x)
    assert type(out) is ImageClassifierOutputWithNoAttention
    assert torch.equal(out.logits, expected)
