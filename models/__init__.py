"""Model zoo: seeded fp32 models, each paired with a synthetic, learnable task.

``build(name, size=..., seed=...)`` returns a fresh :class:`ZooTask`. All data is
generated in code (nothing is downloaded), and every model traces with
``torch.fx.symbolic_trace``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

ZOO_NAMES = ("mlp", "resnet", "bert", "gpt", "gcn", "gat")
SIZES = ("small", "full")

# ``step`` value reserved for data that is fixed for the whole task
# (cluster centres, class patterns, the language's transition table, ...).
FIXED_DATA_STEP = -1


@dataclass
class ZooTask:
    name: str
    model: torch.nn.Module  # fp32, fresh, seeded
    example_inputs: tuple  # one batch of inputs (tuple of tensors), to trace/run the model
    loss_fn: Callable  # loss_fn(output, target) -> scalar tensor
    make_batch: Callable[[int], tuple[tuple, torch.Tensor]]  # make_batch(step) -> (inputs, target)
    num_classes: int | None = None

    def train_losses(self, module: torch.nn.Module, steps: int, lr: float) -> list[float]:
        """The loss of each of `steps` Adam steps of `module` (this task's model, converted or not) on
        make_batch(0..steps-1); the loss is taken in fp32, as a user's loop under AMP takes it."""
        optimizer = torch.optim.Adam(module.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            inputs, target = self.make_batch(step)
            loss = self.loss_fn(module(*inputs).float(), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses


def batch_generator(seed: int, step: int) -> torch.Generator:
    """CPU generator whose stream depends only on ``(seed, step)``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step + 1)


def build(name: str, *, size: str = "small", seed: int = 0) -> ZooTask:
    """Build a fresh task; ``size`` is "small" (tests) or "full" (benchmarks)."""
    if name not in ZOO_NAMES:
        raise ValueError(f"unknown model {name!r}; expected one of {ZOO_NAMES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    model_module = importlib.import_module(f"{__name__}.{name}")
    # Seed parameter initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_module.build_task(size=size, seed=seed)


__all__ = ["ZOO_NAMES", "SIZES", "ZooTask", "build", "batch_generator"]
