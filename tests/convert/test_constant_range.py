"""A constant fp16 cannot hold (masked_fill(-1e9), a -1e9 added to scores): the conversion keeps the path
of its value fp32 up to the first reader that no longer carries it (tests/convert/test_constants_beyond_range.py);
where the user forces a reader low anyway, it warns, explain() says so, compare() finds the node that turns
it into inf/NaN."""
import re
import warnings

import pytest
import torch

from amp_compiler import compare, convert, explain
from amp_compiler import FP16RangeWarning
from test_compare import MaskedAttention      # masked_fill(-1e9), then softmax: float16 at O2/O3


class AddedMask(MaskedAttention):
    """The other common form: (1 - keep) * -1e9 added to the scores."""

    def forward(self, x, keep):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) + (1.0 - keep) * -1e9
        return torch.softmax(scores, -1) @ x


class BufferMask(MaskedAttention):
    """A tensor constant: a stored additive mask holding -1e9."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.triu(torch.full((4, 4), -1e9), diagonal=1))

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) + self.bias, -1) @ x


def inputs():
    torch.manual_seed(0)
    x, mask = torch.randn(2, 4, 8), torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = True                         # a fully masked row: all -inf in fp16 -> NaN after softmax
    return x, mask


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_float16_softmax_forced_low_after_masked_fill_minus_1e9_warns_and_compare_finds_the_nan(level):
    model, (x, mask) = MaskedAttention(), inputs()
    with pytest.warns(FP16RangeWarning) as caught:
        gm = convert(model, level, example_inputs=(x, mask), force_low=["softmax"])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert re.match(r"masked_fill reads the constant -1e\+09, beyond fp16's 65504 .*reaches softmax \(softmax\) "
                    r"in float16, where it becomes -inf", message)
    assert caught[0].filename == __file__                     # points at the convert() call
    summary = "\n".join(explain(gm).summary_lines())
    assert "WARNING: masked_fill reads the constant -1e+09" in summary
    assert explain(gm).to_dict()["warnings"] == [message]
    report = compare(model, gm, (x, mask))
    assert not report.passed and report.outputs[0].non_finite > 0
    assert report.first_failure.node == "masked_fill_float16" and report.first_failure.non_finite > 0
    # without the user's force_low the softmax stays fp32: no warning, no NaN
    with warnings.catch_warnings():
        warnings.simplefilter("error", FP16RangeWarning)
        fixed = convert(model, level, example_inputs=(x, mask))
    assert compare(model, fixed, (x, mask)).passed


@pytest.mark.parametrize("level,dtype", [("O1", torch.float16), ("O2", torch.bfloat16), ("O3", torch.bfloat16)])
def test_no_warning_where_the_value_stays_fp32_or_bf16_holds_it(level, dtype):
    model, (x, mask) = MaskedAttention(), inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FP16RangeWarning)
        gm = convert(model, level, dtype=dtype, example_inputs=(x, mask))
    assert explain(gm).warnings == [] and "WARNING" not in str(explain(gm))
    assert compare(model, gm, (x, mask)).passed


def test_a_minus_1e9_added_to_the_scores_is_followed_to_its_float16_reader():
    model, (x, mask) = AddedMask(), inputs()
    keep = (~mask).float()
    with pytest.warns(FP16RangeWarning, match=r"^mul reads the constant -1e\+09.*reaches add \(add\) in float16"):
        gm = convert(model, "O2", example_inputs=(x, keep), force_low=["add"])
    assert not compare(model, gm, (x, keep)).passed
    with warnings.catch_warnings():
        warnings.simplefilter("error", FP16RangeWarning)
        convert(model, "O1", example_inputs=(x, keep))        # add and softmax stay fp32 at O1
        assert compare(model, convert(model, "O2", example_inputs=(x, keep)), (x, keep)).passed


def test_a_tensor_constant_beyond_fp16_warns():
    model, (x, _) = BufferMask(), inputs()
    with pytest.warns(FP16RangeWarning, match=r"^the tensor constant bias holds -1e\+09.*reaches add"):
        convert(model, "O2", example_inputs=(x,), force_low=["add"])
