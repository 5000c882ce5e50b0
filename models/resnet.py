"""ResNet-style CNN (conv-BatchNorm-ReLU residual blocks) on synthetic striped images.

Class ``c`` images carry a class colour tint plus stripes at a class-specific
orientation (random phase per image), under Gaussian pixel noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from . import FIXED_DATA_STEP, ZooTask, batch_generator


@dataclass(frozen=True)
class ResNetConfig:
    image_size: int
    stage_widths: tuple[int, ...]
    blocks_per_stage: int
    num_classes: int
    batch_size: int
    in_channels: int = 3
    noise_std: float = 1.0
    stripe_cycles: float = 3.0  # stripe periods across the image


CONFIGS = {
    "small": ResNetConfig(image_size=16, stage_widths=(8, 16), blocks_per_stage=1, num_classes=4, batch_size=16),
    "full": ResNetConfig(image_size=32, stage_widths=(16, 32, 64), blocks_per_stage=2, num_classes=10, batch_size=32),
}


class ResidualBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, stage_widths: tuple[int, ...], blocks_per_stage: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, stage_widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(stage_widths[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        width = stage_widths[0]
        for stage_index, stage_width in enumerate(stage_widths):
            for block_index in range(blocks_per_stage):
                stride = 2 if stage_index > 0 and block_index == 0 else 1
                blocks.append(ResidualBlock(width, stage_width, stride))
                width = stage_width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.pool(self.blocks(self.stem(images)))
        return self.head(torch.flatten(features, 1))


class StripedImageBatches:
    def __init__(self, config: ResNetConfig, seed: int):
        self.config = config
        self.seed = seed
        generator = batch_generator(seed, FIXED_DATA_STEP)
        self.class_colours = torch.rand(config.num_classes, config.in_channels, generator=generator) * 2 - 1
        angles = torch.arange(config.num_classes, dtype=torch.float32) * (math.pi / config.num_classes)
        coords = torch.arange(config.image_size, dtype=torch.float32) / config.image_size
        # (classes, H, W) stripe phase ramp for each class orientation
        self.class_ramps = 2 * math.pi * config.stripe_cycles * (
            torch.cos(angles)[:, None, None] * coords[None, None, :]
            + torch.sin(angles)[:, None, None] * coords[None, :, None]
        )

    def __call__(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        config = self.config
        generator = batch_generator(self.seed, step)
        labels = torch.randint(config.num_classes, (config.batch_size,), generator=generator)
        phases = torch.rand(config.batch_size, 1, 1, generator=generator) * (2 * math.pi)
        stripes = torch.cos(self.class_ramps[labels] + phases)  # (B, H, W)
        colours = self.class_colours[labels][:, :, None, None]  # (B, C, 1, 1)
        shape = (config.batch_size, config.in_channels, config.image_size, config.image_size)
        noise = config.noise_std * torch.randn(shape, generator=generator)
        images = 0.5 * colours + stripes[:, None] * colours.abs() + noise
        return (images,), labels


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    model = ResNet(config.in_channels, config.stage_widths, config.blocks_per_stage, config.num_classes)
    make_batch = StripedImageBatches(config, seed)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="resnet",
        model=model,
        example_inputs=example_inputs,
        loss_fn=nn.CrossEntropyLoss(),
        make_batch=make_batch,
        num_classes=config.num_classes,
    )
