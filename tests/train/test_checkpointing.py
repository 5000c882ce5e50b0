"""Activation checkpointing (torch.utils.checkpoint, reentrant or not) and custom autograd.Functions inside
a model train correctly through build_train_network and through a converted model in a plain loop: their
backward is the user's, and at O0 the gradients equal the unconverted model's."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from amp_compiler import FixedLossScaleManager, build_train_network, convert


class DoubleWithOwnBackward(torch.autograd.Function):
    """Forward x * 2, backward g * 3: not the true derivative, so only the user's backward gives these grads."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class CheckpointedNet(nn.Module):
    def __init__(self, checkpointing, custom_function=True):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(6, 8), Block(), nn.Linear(8, 3)
        self.checkpointing, self.custom_function = checkpointing, custom_function

    def forward(self, x):
        h = self.embed(x)
        if self.checkpointing == "none":
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.checkpointing == "reentrant")
        h = DoubleWithOwnBackward.apply(h) if self.custom_function else h * 2
        return self.head(h)


KINDS = ["none", "non-reentrant", "reentrant"]


def data(steps=3):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator))
            for _ in range(steps)]


def eager_training(model, batches, forward=None):
    """A plain fp32-loss loop over `forward` (default: the unconverted model itself): gradients of the
    first step; the model's parameters have trained on every batch."""
    forward = forward or model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first_grads = None
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward(x).float(), y).backward()
        first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return first_grads


def train_step_training(model, batches, level, dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level=level, dtype=dtype,
                               loss_scale_manager=FixedLossScaleManager(2.0 ** 8) if level != "O0" else None)
    first_grads = None
    for x, y in batches:
        assert not step(x, y)[1]
        first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
    return first_grads


def plain_loop_training(model, batches, level, dtype):
    return eager_training(model, batches, forward=convert(model, level, dtype=dtype))


TRAINERS = {"build_train_network": train_step_training, "convert + plain loop": plain_loop_training}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS.values(), ids=TRAINERS)
@pytest.mark.parametrize("checkpointing", KINDS)
def test_o0_gradients_and_training_equal_the_unconverted_model(checkpointing, trainer):
    torch.manual_seed(0)
    model = CheckpointedNet(checkpointing)
    reference = copy.deepcopy(model)
    batches = data()
    expected = eager_training(reference, batches)
    grads = trainer(model, batches, "O0", torch.float16)
    for (name, p), grad, want, q in zip(model.named_parameters(), grads, expected, reference.parameters()):
        assert type(p.grad) is torch.Tensor, f"{name}: the real .grad holds a {type(p.grad).__name__}"
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("trainer", TRAINERS.values(), ids=TRAINERS)
@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
def test_o2_gradients_are_close_to_the_unconverted_model(checkpointing, trainer, dtype):
    torch.manual_seed(0)
    model = CheckpointedNet(checkpointing)
    reference = copy.deepcopy(model)
    batches = data(steps=1)
    expected = eager_training(reference, batches)
    grads = trainer(model, batches, "O2", dtype)
    for (name, _), grad, want in zip(model.named_parameters(), grads, expected):
        error = (grad - want).norm()
        assert error <= 3e-2 * want.norm() + 1e-4, f"{name}: off by {error:.3g} of {want.norm():.3g}"


def test_the_custom_backward_is_the_one_that_runs():
    """The same model with the true derivative (h * 2 in autograd) trains differently: the test above
    would notice a step that differentiated the Function's forward instead of calling its backward."""
    torch.manual_seed(0)
    custom = CheckpointedNet("reentrant")
    plain = CheckpointedNet("reentrant", custom_function=False)
    plain.load_state_dict(custom.state_dict())
    batches = data(steps=1)
    custom_grads = train_step_training(custom, batches, "O0", torch.float16)
    plain_grads = train_step_training(plain, batches, "O0", torch.float16)
    torch.testing.assert_close(custom_grads[0], 1.5 * plain_grads[0], rtol=1e-5, atol=1e-7)
