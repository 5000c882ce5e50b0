"""What a training step did with its gradients, and a running account of it for the report.

`Overflow` is the flag a step returns: falsy when the gradients were finite, else whether the update was
SKIPPED or APPLIED anyway (the user asked for that with drop_overflow_update=False). `StepHistory` tells
the skips of a dynamic scale calibrating itself (the first steps, each lowering the scale before any
update was applied) from later ones, so the demo and the report can say which is which.
"""
from __future__ import annotations

import enum
import math


class Overflow(enum.IntEnum):
    NONE = 0        # finite gradients: the update was applied
    SKIPPED = 1     # inf/nan gradients: the update was dropped, everything left as it was
    APPLIED = 2     # inf/nan gradients applied anyway (drop_overflow_update=False)

    def __str__(self) -> str:
        return self.name.lower()


class StepHistory:
    """Counts of applied and skipped steps; skips before the first applied step that lowered the scale
    are the scale calibrating itself."""

    def __init__(self) -> None:
        self.steps = 0
        self.skipped = 0
        self.applied_non_finite = 0
        self.calibration_skips = 0
        self.first_scale: float | None = None
        self.scale_after_calibration: float | None = None
        self._any_applied = False

    def record(self, outcome: Overflow, scale_used: float, scale_next: float) -> str:
        """Count one step; returns a few words for it ("applied", "skipped: the scale is calibrating itself", ...)."""
        self.steps += 1
        if self.first_scale is None:
            self.first_scale = scale_used
        if outcome is Overflow.SKIPPED:
            self.skipped += 1
            if not self._any_applied and scale_next < scale_used:
                self.calibration_skips += 1
                self.scale_after_calibration = scale_next
                return f"skipped: the scale is calibrating itself ({scale_label(scale_used)} -> {scale_label(scale_next)})"
            return "skipped: inf/nan gradients"
        self._any_applied = True
        if outcome is Overflow.APPLIED:
            self.applied_non_finite += 1
            return "APPLIED with inf/nan gradients (drop_overflow_update=False)"
        return "applied"

    def summary(self) -> str:
        applied = self.steps - self.skipped
        text = f"{self.steps} steps: {applied} applied, {self.skipped} skipped with inf/nan gradients"
        if self.calibration_skips:
            text += (f" ({self.calibration_skips} while the dynamic scale calibrated itself from "
                     f"{scale_label(self.first_scale)} down to {scale_label(self.scale_after_calibration)}: "
                     "it starts high on purpose and backs off on each overflow until the gradients fit fp16; "
                     f"{self.skipped - self.calibration_skips} after that)")
        if self.applied_non_finite:
            text += f"; {self.applied_non_finite} applied despite inf/nan gradients (drop_overflow_update=False)"
        return text


def scale_label(scale: float | None) -> str:
    """2**16 rather than 65536 when the scale is a power of two."""
    if scale is None:
        return "?"
    exponent = math.log2(scale) if scale > 0 else 0.5
    return f"2**{int(exponent)}" if exponent.is_integer() else f"{scale:g}"
