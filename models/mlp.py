"""MLP classifier (Linear/ReLU/Dropout blocks) on synthetic Gaussian clusters."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import FIXED_DATA_STEP, ZooTask, batch_generator


@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden_features: int
    num_hidden_layers: int
    num_classes: int
    batch_size: int
    dropout: float = 0.1
    centre_scale: float = 0.5  # larger = better separated clusters; ~3/sqrt(in_features) keeps it non-trivial


CONFIGS = {
    "small": MLPConfig(in_features=32, hidden_features=64, num_hidden_layers=2, num_classes=4, batch_size=64),
    "full": MLPConfig(
        in_features=512, hidden_features=1024, num_hidden_layers=3, num_classes=10, batch_size=256, centre_scale=0.15
    ),
}


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, num_hidden_layers: int, num_classes: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_hidden_layers):
            layers += [nn.Linear(width, hidden_features), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden_features
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GaussianClusterBatches:
    """Each class is unit-variance noise around its own fixed random centre."""

    def __init__(self, config: MLPConfig, seed: int):
        self.config = config
        self.seed = seed
        centre_generator = batch_generator(seed, FIXED_DATA_STEP)
        self.centres = config.centre_scale * torch.randn(config.num_classes, config.in_features, generator=centre_generator)

    def __call__(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        config = self.config
        generator = batch_generator(self.seed, step)
        labels = torch.randint(config.num_classes, (config.batch_size,), generator=generator)
        noise = torch.randn(config.batch_size, config.in_features, generator=generator)
        return (self.centres[labels] + noise,), labels


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    model = MLP(config.in_features, config.hidden_features, config.num_hidden_layers, config.num_classes, config.dropout)
    make_batch = GaussianClusterBatches(config, seed)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="mlp",
        model=model,
        example_inputs=example_inputs,
        loss_fn=nn.CrossEntropyLoss(),
        make_batch=make_batch,
        num_classes=config.num_classes,
    )
