"""Loss-scale managers: the seeds' (MindSpore's) rules, usable in a plain PyTorch loop like GradScaler.

    manager = DynamicLossScaleManager()     # scale 2**24, /2 on overflow, x2 after 2000 clean steps
    manager.scale(loss).backward()          # GradScaler's plain-loop API (plain_loop.py): scale, unscale_,
    manager.step(opt); manager.update()     # step, update, get_scale, is_enabled, state_dict

`build_train_network` drives the same objects through the seeds' three methods only:
`get_loss_scale()`, `update_loss_scale(overflow)` and `get_drop_overflow_update()`; a custom manager
needs nothing more. Every manager also counts consecutive non-finite steps against `bad_step_max`
(bad_steps.py): a warning when a run gets long, an error past the limit.
"""
from __future__ import annotations

import abc

import torch

from amp_compiler.passes.policy.levels import level_of
from amp_compiler.train.bad_steps import BAD_STEP_MAX, BadStepLimit
from amp_compiler.train.plain_loop import PlainLoopScaling
from amp_compiler.train.scale_arguments import (FP32_MAX, checked_backoff, checked_growth, checked_interval,
                                               checked_scale)

# build_train_network's fp16 default starts here rather than at the seeds' 2**24: on the zoo it skips no
# step where 2**24 skips the first 4-7, and ends at the same or a lower loss (benchmarks/bench_train.py).
TRAIN_STEP_INIT_SCALE = 2.0 ** 16


class LossScaleManager(PlainLoopScaling, abc.ABC):
    """A loss scale and the rule that updates it, plus GradScaler's plain-loop API on top of them.

    Subclasses implement `get_drop_overflow_update`, `_follow_rule` and the `_rule_state` /
    `_load_rule_state` pair used by `state_dict`. With `enabled=False` the scale is 1 and the plain-loop
    methods pass through (as GradScaler's); build_train_network still skips non-finite steps.
    """
    state_type = "LossScaleManager"   # what state_dict() is labelled with and load_state_dict() accepts
    # where the last skipped step went non-finite (overflow_report.locate_overflow); set by record_overflow
    last_overflow_report = None

    def __init__(self, bad_step_max: int | None = BAD_STEP_MAX, enabled: bool = True) -> None:
        super().__init__()
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        self._enabled = enabled
        self.bad_steps = BadStepLimit(bad_step_max)
        self.loss_scale = 1.0
        self.last_overflow = False

    @property
    def bad_step_max(self) -> int | None:
        return self.bad_steps.bad_step_max

    # --- the seeds' API ---------------------------------------------------------------------------
    def get_loss_scale(self) -> float:
        """The scale the next step multiplies the loss by (1.0 when disabled)."""
        return self.loss_scale if self._enabled else 1.0

    @abc.abstractmethod
    def get_drop_overflow_update(self) -> bool:
        """Whether a step whose gradients overflowed is skipped."""

    def update_loss_scale(self, overflow: bool) -> None:
        """Apply the rule after a step that did (not) overflow, and count it against bad_step_max."""
        if self._enabled:
            self._follow_rule(bool(overflow))
        self._record_outcome(overflow)

    def record_overflow(self, report):
        """Keep `report` (an OverflowReport from locate_overflow, or None) as last_overflow_report; returns it."""
        self.last_overflow_report = report
        return report

    def set_loss_scale(self, value: float) -> None:
        self.loss_scale = checked_scale(value, "the loss scale")

    @abc.abstractmethod
    def _follow_rule(self, overflow: bool) -> None:
        """Move the scale after a step that did (not) overflow."""

    def _record_outcome(self, overflow: bool) -> None:
        self.last_overflow = bool(overflow)
        self.bad_steps.record(self.last_overflow, skipped=self.last_overflow and self.get_drop_overflow_update(),
                              loss_scale=self.get_loss_scale())

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scale, the rule's settings and counters; {} when disabled (as GradScaler's)."""
        if not self._enabled:
            return {}
        return {"type": self.state_type, "loss_scale": self.loss_scale, "bad_step_max": self.bad_step_max,
                "consecutive_bad_steps": self.bad_steps.consecutive, **self._rule_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict(); a no-op when disabled (as GradScaler's)."""
        if not self._enabled:
            return
        if not state:
            raise ValueError("the state_dict is empty: it was saved by a disabled manager (enabled=False); "
                             "start from the constructor's settings instead of loading it")
        if state.get("type") != self.state_type:
            raise ValueError(f"state_dict is from a {state.get('type')!r}, this manager is a {self.state_type!r}")
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"state_dict is missing {missing}")
        self.set_loss_scale(state["loss_scale"])
        self.bad_steps = BadStepLimit(state["bad_step_max"])
        self.bad_steps.consecutive = int(state["consecutive_bad_steps"])
        self._load_rule_state(state)
        self._optimizer_states = {}
        self._scaled_since_update = False   # gradients scaled before the load used another scale

    @abc.abstractmethod
    def _rule_state(self) -> dict:
        """The rule's own state, for state_dict()."""

    @abc.abstractmethod
    def _load_rule_state(self, state: dict) -> None:
        """Restore what _rule_state() returned."""


class FixedLossScaleManager(LossScaleManager):
    """A constant scale; with drop_overflow_update an overflowing step is skipped, else applied anyway."""
    state_type = "FixedLossScaleManager"

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True, *,
                 bad_step_max: int | None = BAD_STEP_MAX, enabled: bool = True) -> None:
        super().__init__(bad_step_max, enabled)
        self.loss_scale = checked_scale(loss_scale, "loss_scale")
        if not isinstance(drop_overflow_update, bool):
            raise ValueError(f"drop_overflow_update must be True or False, got {drop_overflow_update!r}")
        self.drop_overflow_update = drop_overflow_update

    def get_drop_overflow_update(self) -> bool:
        return self.drop_overflow_update

    def _follow_rule(self, overflow: bool) -> None:
        pass  # the scale is constant

    def _rule_state(self) -> dict:
        return {"drop_overflow_update": self.drop_overflow_update}

    def _load_rule_state(self, state: dict) -> None:
        self.drop_overflow_update = bool(state["drop_overflow_update"])

    def __repr__(self) -> str:
        return f"FixedLossScaleManager(loss_scale={self.loss_scale}, drop_overflow_update={self.drop_overflow_update})"


class DynamicLossScaleManager(LossScaleManager):
    """Overflow: the step is skipped and scale *= backoff_factor (1/scale_factor unless given; never below
    1); after `scale_window` clean steps since the last overflow or growth: scale *= scale_factor.

    GradScaler's names read the same settings: get/set_growth_factor (scale_factor), get/set_backoff_factor,
    get/set_growth_interval (scale_window). A torch.amp.GradScaler state_dict loads as it is.
    """
    state_type = "DynamicLossScaleManager"

    def __init__(self, init_loss_scale: float = 2 ** 24, scale_factor: float = 2, scale_window: int = 2000, *,
                 backoff_factor: float | None = None, bad_step_max: int | None = BAD_STEP_MAX,
                 enabled: bool = True) -> None:
        super().__init__(bad_step_max, enabled)
        self.loss_scale = checked_scale(init_loss_scale, "init_loss_scale")
        self.scale_factor = checked_growth(scale_factor, "scale_factor")
        self.backoff_factor = 1.0 / self.scale_factor if backoff_factor is None else \
            checked_backoff(backoff_factor, "backoff_factor")
        self.scale_window = checked_interval(scale_window, "scale_window")
        self.clean_steps = 0              # clean steps since the last overflow or growth

    def get_drop_overflow_update(self) -> bool:
        return True

    def _follow_rule(self, overflow: bool) -> None:
        if overflow:
            self.loss_scale = max(self.loss_scale * self.backoff_factor, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.scale_window:
            self.clean_steps = 0
            if self.loss_scale * self.scale_factor <= FP32_MAX:
                self.loss_scale *= self.scale_factor

    # --- GradScaler's names ------------------------------------------------------------------------
    def get_growth_factor(self) -> float:
        return self.scale_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.scale_factor = checked_growth(new_factor, "growth_factor")

    def get_backoff_factor(self) -> float:
        return self.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.backoff_factor = checked_backoff(new_factor, "backoff_factor")

    def get_growth_interval(self) -> int:
        return self.scale_window

    def set_growth_interval(self, new_interval: int) -> None:
        self.scale_window = checked_interval(new_interval, "growth_interval")

    def load_state_dict(self, state: dict) -> None:
        if self._enabled and "type" not in state and "_growth_tracker" in state:
            state = self._from_torch_grad_scaler(state)
        super().load_state_dict(state)

    def _from_torch_grad_scaler(self, state: dict) -> dict:
        """torch.amp.GradScaler.state_dict() in this manager's terms (a migrating user's checkpoint)."""
        return {"type": self.state_type, "loss_scale": state["scale"], "scale_factor": state["growth_factor"],
                "backoff_factor": state["backoff_factor"], "scale_window": state["growth_interval"],
                "clean_steps": state["_growth_tracker"], "bad_step_max": self.bad_step_max,
                "consecutive_bad_steps": 0}

    def _rule_state(self) -> dict:
        return {"scale_factor": self.scale_factor, "backoff_factor": self.backoff_factor,
                "scale_window": self.scale_window, "clean_steps": self.clean_steps}

    def _load_rule_state(self, state: dict) -> None:
        self.scale_factor = checked_growth(state["scale_factor"], "scale_factor")
        self.backoff_factor = checked_backoff(state["backoff_factor"], "backoff_factor")
        self.scale_window = checked_interval(state["scale_window"], "scale_window")
        self.clean_steps = int(state["clean_steps"])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(loss_scale={self.loss_scale:g}, scale_factor={self.scale_factor:g}, "
                f"backoff_factor={self.backoff_factor:g}, scale_window={self.scale_window})")


def default_loss_scale_manager(level: str, dtype: torch.dtype) -> LossScaleManager | None:
    """build_train_network's defaults: O2 scales fp16 dynamically (from TRAIN_STEP_INIT_SCALE); bf16 has
    fp32's range, so its O2 default is scale 1. O0, O1 and O3 have no manager unless one is given (the
    step still skips non-finite updates)."""
    if level_of(level).loss_scaling != "dynamic":
        return None
    if dtype == torch.bfloat16:
        return FixedLossScaleManager(1.0, drop_overflow_update=True)
    return DynamicLossScaleManager(init_loss_scale=TRAIN_STEP_INIT_SCALE)
