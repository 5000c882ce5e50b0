"""torch.amp.GradScaler's plain-loop methods, built on the seeds' three loss-scale methods.

    scaler.scale(loss).backward()        # or scale a list/tuple/dict of losses
    scaler.unscale_(optimizer)           # optional, once per optimizer per step: before clipping
    scaler.step(optimizer)               # optimizer.step() unless its gradients are inf/nan
    scaler.update()                      # the rule, fed with this iteration's overflow; update(new_scale) sets it

An iteration runs from one update() to the next, and unscale_() and step() raise unless scale() ran in
it: GradScaler refuses a step before its first scale() only, and in any later iteration divides gradients
that were never scaled by the scale. Several optimizers may step in one iteration (each skips on its own
inf/nan; update() sees them all), and gradients may accumulate over micro-batches before step(). With
`enabled=False` every method passes through, as GradScaler's do. When torch.distributed is initialised,
`unscale_` all-reduces the overflow flag so every rank skips the same steps.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist


class PlainLoopScaling:
    """Mixed into LossScaleManager: needs `_enabled`, `get_loss_scale`, `get_drop_overflow_update`,
    `update_loss_scale`, `set_loss_scale` and `_record_outcome`."""
    _scaled_since_update = False   # a manager pickled before this flag existed loads with it unset

    def __init__(self) -> None:
        # Per optimizer, since the last update(): {"unscaled": bool, "stepped": bool, "found_inf": bool}
        self._optimizer_states: dict[int, dict[str, bool]] = {}
        self._scaled_since_update = False

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """GradScaler's name for get_loss_scale(): the current scale, 1.0 when disabled."""
        return float(self.get_loss_scale())

    def scale(self, outputs):
        """`outputs * scale` for a tensor, or for each tensor in a (nested) list, tuple or dict; a
        low-precision tensor is scaled in fp32 so the product itself cannot overflow."""
        if not self._enabled:
            return outputs
        scaled = self._scaled(outputs)
        self._scaled_since_update = True   # only once the outputs were accepted
        return scaled

    def _scaled(self, outputs):
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype in (torch.float16, torch.bfloat16):
                outputs = outputs.float()
            return outputs * self.get_loss_scale()
        if isinstance(outputs, Mapping):
            return type(outputs)({key: self._scaled(value) for key, value in outputs.items()})
        if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):   # a namedtuple
            return type(outputs)(*(self._scaled(o) for o in outputs))
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self._scaled(o) for o in outputs)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self._scaled, outputs)  # as GradScaler: other iterables come back lazily
        raise TypeError(f"scale() takes a tensor or a list/tuple/dict of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/nan."""
        if not self._enabled:
            return
        self._require_scaled_gradients("unscale_")
        state = self._state_of(optimizer)
        if state["unscaled"]:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update(): "
                               "call it once per optimizer, after all of its gradients have accumulated")
        if state["stepped"]:
            raise RuntimeError("unscale_() is being called after step() for this optimizer; call update() first")
        found_inf = torch.zeros((), dtype=torch.float32)
        inv_scale = torch.full((), 1.0 / self.get_loss_scale(), dtype=torch.float32)
        by_device_dtype: dict[tuple, list[torch.Tensor]] = {}
        for grad in _gradients_to_unscale(optimizer):
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
        """Unscale (unless already done), then `optimizer.step(*args, **kwargs)` unless the gradients are
        inf/nan and the manager drops such steps. Returns what optimizer.step returned, None if skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("step() with a closure is not supported: the closure would recompute scaled "
                               "gradients after the overflow check")
        self._require_scaled_gradients("step")
        state = self._state_of(optimizer)
        if state["stepped"]:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        if not state["unscaled"]:
            self.unscale_(optimizer)
        state["stepped"] = True
        if state["found_inf"] and self.get_drop_overflow_update():
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Feed this iteration's overflow (any optimizer's) to the rule, then start a new iteration.
        `new_scale` sets the scale instead of applying the rule (as GradScaler.update(new_scale))."""
        if not self._enabled:
            return
        checked = self._optimizer_states
        if new_scale is None and not checked:
            raise RuntimeError("update() was called but no unscale_(optimizer) or step(optimizer) ran since "
                               "the last update(): there is no overflow result to update the scale with")
        overflow = any(s["found_inf"] for s in checked.values())
        self._optimizer_states = {}   # a new iteration starts, even if the bad-step limit raises below
        self._scaled_since_update = False
        if new_scale is None:
            self.update_loss_scale(overflow)
            return
        if checked:
            self._record_outcome(overflow)
        self.set_loss_scale(_scale_value(new_scale))

    def _require_scaled_gradients(self, method: str) -> None:
        # Unscaling gradients that were never scaled would shrink the update by the scale, silently.
        if not self._scaled_since_update:
            raise RuntimeError(
                f"{method}() was called with no scale() since the last update(): unscaling gradients that were "
                f"never scaled divides them by the scale ({self.get_loss_scale():g})\n"
                "call scaler.scale(loss).backward() in each iteration before unscale_()/step(), then update()")

    def _state_of(self, optimizer) -> dict[str, bool]:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return self._optimizer_states.setdefault(id(optimizer), {"unscaled": False, "stepped": False,
                                                                 "found_inf": False})


def _scale_value(new_scale) -> float:
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError("update(new_scale): a tensor scale must have one element and not require grad, got "
                             f"shape {tuple(new_scale.shape)}, requires_grad={new_scale.requires_grad}")
        return float(new_scale.item())
    return new_scale


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
