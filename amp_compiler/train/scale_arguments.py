"""Checks of loss-scale arguments, shared by the managers and the GradScaler drop-in: one message per mistake.

    checked_scale(0.5, "init_scale")   # ValueError: init_scale must be a finite number >= 1 (...)
"""
from __future__ import annotations

import math

import torch

# The scale is an fp32 tensor inside the step, so it must stay a finite fp32 number.
FP32_MAX = torch.finfo(torch.float32).max


def checked_scale(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number >= 1, got {value!r}")
    if not math.isfinite(value) or value < 1 or value > FP32_MAX:
        raise ValueError(f"{name} must be a finite number >= 1 (a scale below 1 would shrink gradients "
                         f"towards underflow), got {value!r}")
    return float(value)


def checked_growth(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1:
        raise ValueError(f"{name} must be a finite number greater than 1, got {value!r}")
    return float(value)


def checked_backoff(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be a number between 0 and 1 (the scale shrinks on overflow), got {value!r}")
    return float(value)


def checked_interval(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (steps), got {value!r}")
    return value
