"""What the front ends' fallbacks keep: the model's own attributes in the copy they call, dynamic dims for
any forward signature, a clear error for a dim the capture fixed, and the options torch.export is given."""
import collections

import pytest
import torch
from torch import nn

from amp_compiler import convert


class AttributeDict(collections.OrderedDict):
    """Like diffusers' FrozenDict: the items are also attributes, set once in __init__ (a .copy() of it
    builds an empty instance and adds the items, without the attributes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            setattr(self, key, value)


class ConfiguredModel(nn.Module):
    """Reads `self.config.scale` in forward; `for row in x` stops torch.fx at the top."""

    def __init__(self):
        super().__init__()
        self.config = AttributeDict(scale=2.0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.stack([self.fc(row) for row in x]) * self.config.scale


def test_the_module_copy_keeps_attributes_of_dict_subclasses():
    model = ConfiguredModel().eval()
    x = torch.randn(3, 4)
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=0.05, atol=0.05)
