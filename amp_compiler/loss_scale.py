"""Loss-scale managers: the seeds' (MindSpore's) semantics, usable in a plain PyTorch loop like GradScaler.

    manager = DynamicLossScaleManager()           # scale 2**24, /2 on overflow, x2 after 2000 clean steps
    manager.scale(loss).backward()                # loss (in fp32) * scale
    manager.unscale_(opt)                         # optional, e.g. before clipping: grads / scale, finds inf/nan
    manager.step(opt)                             # opt.step() unless the gradients overflowed
    manager.update()                              # update_loss_scale(overflow) for this iteration

`build_train_network` drives the same objects through the seeds' three methods only:
`get_loss_scale()`, `update_loss_scale(overflow)` and `get_drop_overflow_update()`; a custom manager
needs nothing more. When torch.distributed is initialised, `unscale_` all-reduces the overflow flag so
every rank skips the same steps (as MindSpore's train cell does).
"""
from __future__ import annotations

import abc
import math

import torch
import torch.distributed as dist

# More consecutive overflows than this means scaling cannot help: the seeds raise (MindSpore: 1000).
MAX_CONSECUTIVE_OVERFLOWS = 1000
# The scale is an fp32 tensor inside the step, so it must stay a finite fp32 number.
FP32_MAX = torch.finfo(torch.float32).max


class LossScaleManager(abc.ABC):
    """A loss scale and the rule that updates it, plus GradScaler's plain-loop API on top of them.

    Subclasses implement `get_loss_scale`, `update_loss_scale`, `get_drop_overflow_update` and the
    `_rule_state` / `_load_rule_state` pair used by `state_dict`.
    """

    def __init__(self) -> None:
        # Per optimizer, since the last update(): {"unscaled": bool, "stepped": bool, "found_inf": bool}
        self._optimizer_states: dict[int, dict[str, bool]] = {}
        self.last_overflow = False

    # --- the seeds' API ---------------------------------------------------------------------------
    @abc.abstractmethod
    def get_loss_scale(self) -> float:
        """The scale the next step multiplies the loss by."""

    @abc.abstractmethod
    def update_loss_scale(self, overflow: bool) -> None:
        """Apply the rule after a step that did (not) overflow."""

    @abc.abstractmethod
    def get_drop_overflow_update(self) -> bool:
        """Whether a step whose gradients overflowed is skipped."""

    # --- GradScaler-style API for a plain loop -----------------------------------------------------
    def scale(self, outputs):
        """`outputs * scale`; a low-precision loss is scaled in fp32 so the product itself cannot overflow."""
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype in (torch.float16, torch.bfloat16):
                outputs = outputs.float()
            return outputs * self.get_loss_scale()
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/nan."""
        state = self._state_of(optimizer)
        if state["unscaled"]:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        if state["stepped"]:
            raise RuntimeError("unscale_() is being called after step() for this optimizer; call update() first")
        grads = _gradients_to_unscale(optimizer)
        found_inf = torch.zeros((), dtype=torch.float32)
        inv_scale = torch.full((), 1.0 / self.get_loss_scale(), dtype=torch.float32)
        by_device_dtype: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            by_device_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), group in by_device_dtype.items():
            found_on_device = torch.zeros((), dtype=torch.float32, device=device)
            # The fused kernel GradScaler uses: one pass multiplies by 1/scale and flags inf/nan.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_on_device, inv_scale.to(device))
            found_inf = torch.maximum(found_inf, found_on_device.cpu())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # every rank must skip the same steps
        state["unscaled"] = True
        state["found_inf"] = bool(found_inf.item())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless already done), then run `optimizer.step()` unless the gradients overflowed."""
        if "closure" in kwargs:
            raise RuntimeError("step() with a closure is not supported: the closure would recompute scaled "
                               "gradients after the overflow check")
        state = self._state_of(optimizer)
        if state["stepped"]:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        if not state["unscaled"]:
            self.unscale_(optimizer)
        state["stepped"] = True
        if state["found_inf"] and self.get_drop_overflow_update():
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Feed this iteration's overflow (any optimizer's) to `update_loss_scale`, then start a new one."""
        if not self._optimizer_states:
            raise RuntimeError("update() was called but no unscale_(optimizer) or step(optimizer) ran since "
                               "the last update(): there is no overflow result to update the scale with")
        overflow = any(s["found_inf"] for s in self._optimizer_states.values())
        self._optimizer_states.clear()
        self.last_overflow = overflow
        self.update_loss_scale(overflow)

    def state_dict(self) -> dict:
        return {"type": type(self).__name__, **self._rule_state()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"state_dict is from a {state.get('type')!r}, this manager is a "
                             f"{type(self).__name__!r}")
        expected = set(self._rule_state())
        missing = sorted(expected - set(state))
        if missing:
            raise ValueError(f"state_dict is missing {missing}")
        self._load_rule_state(state)
        self._optimizer_states.clear()

    @abc.abstractmethod
    def _rule_state(self) -> dict:
        """The rule's own state, for state_dict()."""

    @abc.abstractmethod
    def _load_rule_state(self, state: dict) -> None:
        """Restore what _rule_state() returned."""

    def _state_of(self, optimizer) -> dict[str, bool]:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return self._optimizer_states.setdefault(id(optimizer), {"unscaled": False, "stepped": False,
                                                                 "found_inf": False})


class FixedLossScaleManager(LossScaleManager):
    """A constant scale; with drop_overflow_update an overflowing step is skipped, else applied anyway."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        super().__init__()
        self.loss_scale = _checked_scale(loss_scale, "loss_scale")
        if not isinstance(drop_overflow_update, bool):
            raise ValueError(f"drop_overflow_update must be True or False, got {drop_overflow_update!r}")
        self.drop_overflow_update = drop_overflow_update

    def get_loss_scale(self) -> float:
        return self.loss_scale

    def update_loss_scale(self, overflow: bool) -> None:
        self.last_overflow = bool(overflow)

    def get_drop_overflow_update(self) -> bool:
        return self.drop_overflow_update

    def _rule_state(self) -> dict:
        return {"loss_scale": self.loss_scale, "drop_overflow_update": self.drop_overflow_update}

    def _load_rule_state(self, state: dict) -> None:
        self.loss_scale = _checked_scale(state["loss_scale"], "loss_scale")
        self.drop_overflow_update = bool(state["drop_overflow_update"])

    def __repr__(self) -> str:
        return f"FixedLossScaleManager(loss_scale={self.loss_scale}, drop_overflow_update={self.drop_overflow_update})"


class DynamicLossScaleManager(LossScaleManager):
    """Overflow: scale /= factor (never below 1) and the step is skipped; after `scale_window` clean steps
    since the last overflow: scale *= factor. More than 1000 consecutive overflows raise RuntimeError."""

    def __init__(self, init_loss_scale: float = 2 ** 24, scale_factor: float = 2,
                 scale_window: int = 2000) -> None:
        super().__init__()
        self.loss_scale = _checked_scale(init_loss_scale, "init_loss_scale")
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float)) \
                or not math.isfinite(scale_factor) or scale_factor <= 1:
            raise ValueError(f"scale_factor must be a finite number greater than 1, got {scale_factor!r}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"scale_window must be a positive integer (steps), got {scale_window!r}")
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.clean_steps = 0              # clean steps since the last overflow or growth
        self.consecutive_overflows = 0

    def get_loss_scale(self) -> float:
        return self.loss_scale

    def get_drop_overflow_update(self) -> bool:
        return True

    def update_loss_scale(self, overflow: bool) -> None:
        self.last_overflow = bool(overflow)
        if overflow:
            self.loss_scale = max(self.loss_scale / self.scale_factor, 1.0)
            self.clean_steps = 0
            self.consecutive_overflows += 1
            if self.consecutive_overflows > MAX_CONSECUTIVE_OVERFLOWS:
                raise RuntimeError(
                    f"the gradients overflowed (inf/nan) in {self.consecutive_overflows} consecutive steps, "
                    f"more than the {MAX_CONSECUTIVE_OVERFLOWS} allowed, with the loss scale now "
                    f"{self.loss_scale:g}: the model or data produce non-finite values whatever the scale "
                    "(check the inputs and the learning rate, or train at O0 to find the op)")
            return
        self.consecutive_overflows = 0
        self.clean_steps += 1
        if self.clean_steps >= self.scale_window:
            self.clean_steps = 0
            if self.loss_scale * self.scale_factor <= FP32_MAX:
                self.loss_scale *= self.scale_factor

    def _rule_state(self) -> dict:
        return {"loss_scale": self.loss_scale, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window, "clean_steps": self.clean_steps,
                "consecutive_overflows": self.consecutive_overflows}

    def _load_rule_state(self, state: dict) -> None:
        restored = DynamicLossScaleManager(state["loss_scale"], state["scale_factor"], state["scale_window"])
        self.loss_scale, self.scale_factor = restored.loss_scale, restored.scale_factor
        self.scale_window = restored.scale_window
        self.clean_steps = int(state["clean_steps"])
        self.consecutive_overflows = int(state["consecutive_overflows"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaleManager(loss_scale={self.loss_scale:g}, scale_factor={self.scale_factor:g}, "
                f"scale_window={self.scale_window})")


def default_loss_scale_manager(level: str, dtype: torch.dtype) -> LossScaleManager | None:
    """The seeds' level defaults: O2 scales dynamically; bf16 has fp32's range, so its default is scale 1
    with non-finite steps skipped. O0, O1 and O3 have no manager unless one is given."""
    if level != "O2":
        return None
    if dtype == torch.bfloat16:
        return FixedLossScaleManager(1.0, drop_overflow_update=True)
    return DynamicLossScaleManager()


def _checked_scale(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number >= 1, got {value!r}")
    if not math.isfinite(value) or value < 1 or value > FP32_MAX:
        raise ValueError(f"{name} must be a finite number >= 1 (a scale below 1 would shrink gradients "
                         f"towards underflow), got {value!r}")
    return float(value)


def _gradients_to_unscale(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = []
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            if param.grad.dtype == torch.float16:
                raise ValueError(
                    f"parameter {index} {tuple(param.shape)} of the optimizer has float16 gradients: keep "
                    "the parameters fp32 (the master weights) and let the low-precision copies live in the "
                    "converted graph (amp_compiler.convert does this); unscaling in fp16 loses the small "
                    "gradients the scale was meant to save")
            if param.grad.is_sparse:
                param.grad = param.grad.coalesce()  # duplicate indices would add up after the check
                grads.append(param.grad._values())
            else:
                grads.append(param.grad)
    return grads
