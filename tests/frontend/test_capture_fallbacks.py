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


class ShapeBranchStarArgs(nn.Module):
    """`forward(self, *inputs)` (a wrapper's usual signature) with a branch on a shape: torch.export."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *inputs):
        x, bias = inputs
        if x.shape[-1] > 2:
            return self.fc(x) + bias
        return x


def test_a_star_args_forward_keeps_its_batch_dim_dynamic():
    torch.manual_seed(0)
    model = ShapeBranchStarArgs().eval()
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(2, 4), torch.randn(2, 4)))
    assert gm.meta["amp"]["frontend"] == "torch.export"
    x, bias = torch.randn(3, 4), torch.randn(3, 4)    # a batch size the capture never saw
    with torch.no_grad():
        torch.testing.assert_close(gm(x, bias), model(x, bias), rtol=0.05, atol=0.05)


def test_a_fixed_dim_is_reported_and_a_call_with_another_size_names_it():
    gm = convert(ShapeBranchStarArgs().eval(), "O1", dtype=torch.bfloat16,
                 example_inputs=(torch.randn(2, 4), torch.randn(2, 4)))
    assert any("input inputs_0: dim 1=4 fixed" in note for note in gm.meta["amp"]["notes"]), gm.meta["amp"]["notes"]
    with pytest.raises(ValueError, match=r"input inputs_0 has size 5 at dim 1, but the converted graph was captured "
                                         r"with 4 there"):
        gm(torch.randn(3, 5), torch.randn(3, 4))


class ValueBranch(nn.Module):
    """A branch on a value: neither torch.fx nor torch.export captures forward; its child converts alone."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        if x.sum() > 0:
            return self.body(x)
        return -self.body(x)


def test_the_children_fallback_calibrates_each_child_on_what_it_receives():
    from amp_compiler.passes.node_facts import facts
    x = torch.randn(2, 4)
    samples = [(torch.randn(2, 4),), (torch.randn(5, 4),), (torch.randn(3, 4),)]
    gm = convert(ValueBranch().eval(), "O1", dtype=torch.float16, example_inputs=(x,), calibration_data=samples)
    assert gm.meta["amp"]["frontend"] == "as written, children converted"
    counted = {facts(n).get("range", {}).get("samples") for n in gm.body.graph.nodes} - {None}
    assert counted == {len(samples)}, f"the child saw {counted} calibration samples, not {len(samples)}"


def test_the_children_fallback_says_dynamic_shapes_was_not_used():
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="dynamic_shapes was not used"):
        gm = convert(ValueBranch().eval(), "O1", dtype=torch.float16, example_inputs=(x,),
                     dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert any("dynamic_shapes not used" in note for note in gm.meta["amp"]["notes"])
