"""A converted GraphModule compiles with torch.compile in one graph: none of the helpers its code calls
(amp_cast, amp_module_call, amp_opaque_call, dropout_p_when_training, amp_frozen_check, amp_frozen_cast,
amp_frozen_module_call) breaks the graph.
torch._dynamo.explain counts the breaks; backend "eager" keeps the test fast (inductor only lowers what
dynamo captured)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler.passes.fx import runtime
from models import build

HELPERS = (runtime.amp_cast, runtime.amp_module_call, runtime.amp_opaque_call, runtime.dropout_p_when_training,
           runtime.amp_frozen_cast, runtime.amp_frozen_check, runtime.amp_frozen_module_call)


class Scale(torch.autograd.Function):
    """A custom Function: the fx front end keeps it whole (amp_opaque_call) so its own backward runs."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class FxHelpers(nn.Module):
    """A low Linear (amp_cast), a GRU (amp_module_call), a custom Function (amp_opaque_call), dropout."""

    def __init__(self):
        super().__init__()
        self.fc, self.gru, self.head = nn.Linear(8, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 3)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h, _ = self.gru(self.drop(torch.relu(self.fc(x))))
        return self.head(Scale.apply(h))


class ExportHelpers(nn.Module):
    """A branch on a shape sends it through torch.export; attention dropout follows train()/eval() through
    dropout_p_when_training."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x):
        if x.shape[1] > 4:
            x = x[:, :4]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.head(attended)


HELPERS_IN = {"fx_helpers": {runtime.amp_module_call, runtime.amp_opaque_call},
              "export_helpers": {runtime.dropout_p_when_training}}


def _cases():
    cases = {name: (lambda name=name: _zoo(name)) for name in ("mlp", "resnet", "gpt")}
    cases["fx_helpers"] = lambda: (FxHelpers(), (torch.randn(2, 5, 8),))
    cases["export_helpers"] = lambda: (ExportHelpers().train(), (torch.randn(2, 5, 8),))
    return cases


def _zoo(name):
    task = build(name, size="small")
    return task.model, task.example_inputs


def _used_helpers(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.target in HELPERS}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eval", "eval_frozen", "train"])
@pytest.mark.parametrize("name", list(_cases()))
def test_a_converted_graph_compiles_without_graph_breaks(name, mode):
    model, inputs = _cases()[name]()
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs,
                              freeze=mode == "eval_frozen")
    gm.train(mode == "train")
    expected_helpers = {runtime.amp_cast} | ({runtime.amp_frozen_cast} if mode == "eval_frozen" else set())
    expected_helpers |= HELPERS_IN.get(name, set())
    if name == "export_helpers" and mode != "train":   # it reads self.training: eval() captures its eval graph,
        expected_helpers -= {runtime.dropout_p_when_training}   # which has no dropout to make live
    if mode == "eval_frozen" and runtime.amp_module_call in expected_helpers:   # frozen: read from the cache
        expected_helpers = expected_helpers - {runtime.amp_module_call} | {runtime.amp_frozen_module_call}
    assert expected_helpers <= _used_helpers(gm)             # the helpers under test are in the graph
    # allow_rnn: dynamo leaves nn.GRU untraced by default, converted or not (a break at the module itself)
    with torch.set_grad_enabled(mode == "train"), torch._dynamo.config.patch(allow_rnn=True):
        explanation = _explain(gm, inputs)
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    assert explanation.graph_count == 1


def _explain(run, inputs):
    torch._dynamo.reset()
    return torch._dynamo.explain(run)(*inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "fx_helpers", "export_helpers"])
def test_a_compiled_train_step_matches_the_eager_one(name):
    model, inputs = _cases()[name]()
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    gm.eval()   # dropout off and batch statistics fixed: both runs compute the same thing
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)   # fullgraph: a graph break is an error
    grads = []
    for run in (gm, compiled):
        model.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(allow_rnn=True):
            run(*inputs).float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for eager, graph in zip(*grads):
        assert torch.allclose(eager, graph, rtol=2e-2, atol=1e-3 * eager.abs().max().item() + 1e-6)
