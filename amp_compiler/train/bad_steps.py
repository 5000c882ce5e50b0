"""The limit of the non-finite policy: consecutive steps with inf/nan gradients, whichever manager (or none).

Every step checks its gradients; a non-finite step is skipped unless the user asked otherwise
(`drop_overflow_update=False`). A run of such steps is normal while a dynamic scale calibrates itself,
suspicious when it goes on (one warning, with the count) and an error past `bad_step_max` (MindSpore's
name and default): by then no scale will help and a silent run would train nothing.
"""
from __future__ import annotations

import warnings

BAD_STEP_MAX = 1000
# A dynamic scale halving down from 2**24 to 1 skips 24 steps; a run twice that long is not calibration.
WARN_AFTER_BAD_STEPS = 50
WHAT_TO_CHECK = ("check the inputs and labels for inf/nan, lower the learning rate, look for log/div/sqrt of "
                 "zero in the model or the loss, or train at O0 to see whether fp32 overflows too")


class NonFiniteGradientsError(RuntimeError):
    """More than `bad_step_max` consecutive training steps had inf/nan gradients."""


class BadStepLimit:
    """Counts consecutive non-finite steps; warns once per run at `warn_after`, raises past `bad_step_max`."""

    def __init__(self, bad_step_max: int | None = BAD_STEP_MAX) -> None:
        self.bad_step_max = checked_bad_step_max(bad_step_max)
        self.consecutive = 0
        self._warned = False

    @property
    def warn_after(self) -> int:
        if self.bad_step_max is None:
            return WARN_AFTER_BAD_STEPS
        return max(1, min(WARN_AFTER_BAD_STEPS, self.bad_step_max // 2))

    def record(self, non_finite: bool, skipped: bool, loss_scale: float) -> None:
        """Count one step; `skipped` says whether its update was dropped (else applied anyway)."""
        if not non_finite:
            self.consecutive = 0
            self._warned = False
            return
        self.consecutive += 1
        what = "were skipped" if skipped else "were applied anyway (drop_overflow_update=False)"
        if self.bad_step_max is not None and self.consecutive > self.bad_step_max:
            raise NonFiniteGradientsError(
                f"{self.consecutive} consecutive training steps had non-finite (inf/nan) gradients and {what}, "
                f"more than bad_step_max={self.bad_step_max}, with the loss scale now {loss_scale:g}: no loss "
                f"scale fixes this; {WHAT_TO_CHECK} (bad_step_max=None disables this error)")
        if self.consecutive >= self.warn_after and not self._warned:
            self._warned = True
            limit = f"training stops with an error after {self.bad_step_max} of them" \
                if self.bad_step_max is not None else "nothing stops it (bad_step_max=None)"
            warnings.warn(f"{self.consecutive} consecutive training steps had non-finite (inf/nan) gradients and "
                          f"{what} (loss scale now {loss_scale:g}): the model is not training, and {limit}; "
                          f"{WHAT_TO_CHECK}", RuntimeWarning, stacklevel=4)


def checked_bad_step_max(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bad_step_max must be a positive number of steps (or None for no limit), got {value!r}")
    return value
