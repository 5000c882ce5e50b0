"""convert(): what the front end captures: control flow and the export fallback, tracing errors, optional arguments, save/deepcopy."""
import pytest
import torch
from torch import nn

from amp_compiler import TracingError, convert, explain
from amp_testing import assert_close_to_fp32, precision_by_op


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 1:  # Python control flow on a shape: fx cannot trace it
            x = x * 2
        return torch.softmax(self.fc(x), -1)


class ValueBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: neither front end can capture it
            return x * 2
        return x


def test_shape_control_flow_falls_back_to_torch_export():
    model = ShapeBranch()
    x = torch.randn(3, 4)
    gm = convert(model, "O1", example_inputs=(x,))
    assert gm.meta["amp"]["frontend"] == "torch.export"
    assert precision_by_op(gm)["linear"] == {"low"} and precision_by_op(gm)["softmax"] == {"fp32"}
    assert_close_to_fp32(gm(x), model(x), torch.float16)
    assert list(gm.state_dict()) == list(model.state_dict())


def test_tracing_errors_name_the_construct_and_the_remedy():
    with pytest.raises(TracingError, match=r"(?s)could not trace ShapeBranch.*x.shape\[0\] > 1.*example_inputs"):
        convert(ShapeBranch(), "O1")
    with pytest.raises(TracingError, match=r"(?s)neither torch.fx nor torch.export.*x.sum\(\) > 0.*torch.cond"):
        convert(ValueBranch(), "O1", example_inputs=(torch.randn(3),))


@pytest.mark.slow
def test_composite_torch_modules_are_traced_through():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    x = torch.randn(2, 5, 16)
    gm = convert(layer, "O1", example_inputs=(x,))
    painted = precision_by_op(gm)
    assert painted["linear"] == {"low"} and painted["layer_norm"] == {"fp32"}
    assert painted["scaled_dot_product_attention"] == {"low"}
    layer.eval(), gm.eval()
    assert_close_to_fp32(gm(x), layer(x), torch.float16)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=2.0, mask=None):
        y = self.fc(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


def test_optional_arguments_are_traced_with_their_default_unless_given():
    x, mask = torch.randn(2, 4), torch.rand(2, 4) > 0.5
    model = OptionalMask()
    gm = convert(model, "O1")
    assert_close_to_fp32(gm(x, 2.0), model(x, 2.0), torch.float16)
    assert "traced with scale=2.0, mask=None baked in" in str(explain(gm))   # Python values: constants, as in export
    with pytest.raises(AssertionError, match="scale=2.0 baked in"):
        gm(x, 3.0)
    with pytest.raises(AssertionError, match="mask=None baked in"):
        gm(x, 2.0, mask)
    gm = convert(model, "O1", example_inputs=(x, 2.0, mask))
    assert_close_to_fp32(gm(x, 2.0, mask), model(x, 2.0, mask), torch.float16)


def test_export_fallback_leaves_the_users_module_untouched():
    class LiftsConstant(nn.Module):
        def forward(self, x):
            if x.shape[0] > 1:
                return x + torch.tensor([1.0])
            return x

    model = LiftsConstant()
    before = (set(model._non_persistent_buffers_set), dict(model._buffers), dict(model._modules))
    convert(model, "O1", example_inputs=(torch.randn(3, 1),))
    assert (set(model._non_persistent_buffers_set), dict(model._buffers), dict(model._modules)) == before


@pytest.mark.slow
def test_converted_graph_survives_torch_save_and_deepcopy(tmp_path):
    import copy

    from models import build

    task = build("bert", size="small")  # its forward is annotated (token_ids: torch.Tensor)
    gm = convert(task.model, "O1")
    gm.eval()
    expected = gm(*task.example_inputs)
    torch.save(gm, tmp_path / "gm.pt")
    loaded = torch.load(tmp_path / "gm.pt", weights_only=False)
    loaded.eval()
    assert torch.equal(loaded(*task.example_inputs), expected)
    assert torch.equal(copy.deepcopy(gm)(*task.example_inputs), expected)
