"""fx/explicit_upcasts.py: which fx nodes are the model's own upcasts of a float value to float32 (every
spelling; on torch.export graphs only where the source line spells float32), how each is named, and the hook
that keeps what computes on the upcast fp32 up to the cast back."""
import pytest
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.explicit_upcasts import is_upcast, keep_fx_upcasts_fp32, spelling
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import PrecisionRules

SPELLINGS = {".float()": lambda h: h.float(), ".to(float32)": lambda h: h.to(torch.float32),
             ".type(torch.float32)": lambda h: h.type(torch.float32)}


class Upcast(nn.Module):
    def __init__(self, spelled=".float()"):
        super().__init__()
        self.up, self.down, self.spelled = nn.Linear(8, 8), nn.Linear(8, 8), spelled

    def forward(self, x, mask):
        h = self.up(x)
        v = torch.tanh(SPELLINGS[self.spelled](h)) * 2.0
        return self.down(v.to(h.dtype)) + mask.float(), h.half()


def traced(model):
    x, mask = torch.randn(2, 8), torch.ones(2, 8, dtype=torch.bool)
    gm = fx.symbolic_trace(model)
    canonicalize(gm)
    infer_dtypes(gm, (x, mask), torch.float16)
    return gm, {n.name: n for n in gm.graph.nodes}


@pytest.mark.parametrize("spelled", SPELLINGS)
def test_a_cast_of_a_float_value_to_float32_is_an_upcast_named_as_written(spelled):
    gm, nodes = traced(Upcast(spelled))
    upcasts = [n for n in gm.graph.nodes if is_upcast(n)]
    assert len(upcasts) == 1 and upcasts[0].args[0] is nodes["up"]
    assert spelling(upcasts[0]) == spelled


def test_a_bool_made_float_a_cast_down_and_a_cast_to_a_variable_dtype_are_not_upcasts():
    _, nodes = traced(Upcast())
    assert not is_upcast(nodes["float_2"])   # mask.float(): a number, not an fp32 computation
    assert not is_upcast(nodes["half"])
    assert not is_upcast(nodes["to"])        # v.to(h.dtype): the dtype is another node's


def export_style_cast(source_line: str) -> fx.Node:
    """aten.to.dtype(h, float32) as torch.export writes it: the dtype is specialised, the source line is not."""
    g = fx.Graph()
    h = g.placeholder("h")
    h.meta["amp"] = {"op": "placeholder", "dtype": torch.float32}
    cast = g.call_function(torch.ops.aten.to.dtype, (h, torch.float32))
    cast.meta["amp"] = {"op": "to", "dtype": torch.float32}
    cast.meta["stack_trace"] = f'  File "model.py", line 7, in forward\n    {source_line}\n'
    return cast


def test_on_torch_export_graphs_the_source_line_says_whether_it_is_an_upcast():
    assert is_upcast(export_style_cast("hidden_states = hidden_states.to(torch.float32)"))
    assert is_upcast(export_style_cast("x = x.float()"))
    assert not is_upcast(export_style_cast("return self.weight * hidden_states.to(input_dtype)"))


def decided(model, hook=True) -> dict:
    gm, _ = traced(model)
    decide_fx_precision(gm, PrecisionRules.build("O2", "float16"), painted=[keep_fx_upcasts_fp32(gm)] if hook else [])
    return {n.name: facts(n) for n in gm.graph.nodes}


def test_the_hook_keeps_the_ops_on_the_upcast_fp32_up_to_the_cast_back():
    f = decided(Upcast())
    assert f["tanh"]["precision"] == f["mul"]["precision"] == "fp32"
    assert f["tanh"]["rule"].startswith("upcast: the model's own .float() at float_1: computes on its fp32 value")
    assert f["up"]["precision"] == f["down"]["precision"] == f["add"]["precision"] == "low"   # past the cast back


def test_without_an_upcast_the_hook_changes_nothing():
    class Plain(Upcast):
        def forward(self, x, mask):
            return self.down(torch.tanh(self.up(x)) * 2.0) + mask.float()

    with_hook, without = decided(Plain()), decided(Plain(), hook=False)
    assert {n: (a.get("precision"), a.get("rule")) for n, a in with_hook.items()} == \
        {n: (a.get("precision"), a.get("rule")) for n, a in without.items()}
    assert with_hook["tanh"]["precision"] == "low"
