"""`amp_compiler.GradScaler`: torch.amp.GradScaler's constructor over the seeds' dynamic rule.

    scaler = amp_compiler.GradScaler("cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=2000, enabled=True)       # the one line that changes

Everything after that line (scale, unscale_, step, update, get_scale, the growth/backoff getters and
setters, state_dict, several optimizers, accumulation, clipping) runs unchanged; the object also drives
build_train_network. A torch GradScaler's state_dict loads as it is. Deliberate differences: the scale
never drops below 1 (the seeds' rule), unscale_()/step() with no scale() since the last update() raise
(torch's raise only before the first scale()), more than `bad_step_max` consecutive inf/nan steps raise,
fp16 gradients are refused (keep fp32 master weights), a low-precision loss is scaled in fp32, and
`device` is only recorded: the scale is a Python float, valid on any device (torch's scaler disables
itself when CUDA is missing).
"""
from __future__ import annotations

from amp_compiler.train.bad_steps import BAD_STEP_MAX
from amp_compiler.train.loss_scale import DynamicLossScaleManager
from amp_compiler.train.scale_arguments import checked_growth, checked_interval, checked_scale


class GradScaler(DynamicLossScaleManager):
    """torch.amp.GradScaler's signature and defaults; see the module docstring for the differences."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 bad_step_max: int | None = BAD_STEP_MAX) -> None:
        # Checked under GradScaler's names first, so an error names the argument the user passed.
        checked_scale(init_scale, "init_scale")
        checked_growth(growth_factor, "growth_factor")
        checked_interval(growth_interval, "growth_interval")
        super().__init__(init_scale, growth_factor, growth_interval, backoff_factor=backoff_factor,
                         bad_step_max=bad_step_max, enabled=enabled)
        self.device = device
