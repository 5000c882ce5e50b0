"""A critical review of the integrations (apex.py, lightning.py, huggingface.py, accelerate.py): each test is a
probe that found, or rules out, a silently wrong result or a crash in a common training pattern."""
import copy

import pytest
import torch
from torch import nn

from amp_compiler import apex


def _tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 4))


def _one_apex_step(model, optimizer, x):
    loss = model(x).float().pow(2).mean()
    optimizer.zero_grad()
    with apex.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_eval_after_a_training_step_with_low_weights_runs_the_eval_graph(level):
    """Validation after a step: the eval-mode capture found the low weights' gradients (bf16) on the fp32
    copies it traces with, failed, and the fallback 'as written' crashed on fp32 inputs against bf16 weights."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = apex.initialize(model, optimizer, opt_level=level, cast_model_type=torch.bfloat16,
                                       verbosity=0)
    x = torch.randn(2, 8)
    _one_apex_step(model, optimizer, x)
    grads = [p.grad.clone() for p in model.parameters()]
    model.eval()
    with torch.no_grad():
        out = model(x)
        weights = [p.float() for p in model.parameters()]
        reference = torch.relu(x.bfloat16() @ weights[0].bfloat16().t() + weights[1].bfloat16()).float()
        reference = (reference.bfloat16() @ weights[2].bfloat16().t() + weights[3].bfloat16()).float()
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), "capture changed the grads"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_second_initialize_of_the_same_o2_model_says_initialize_once():
    """It said 'Call model.float() first': following that advice converts the weights a second time and
    leaves the first masters stale."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="call initialize once"):
        apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="call initialize once"):
        apex.initialize(model, opt_level="O2", verbosity=0)
