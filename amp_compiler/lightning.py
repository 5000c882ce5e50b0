"""Lightning precision plugins that train with amp-compiler's graphs instead of torch.autocast.

    trainer = Trainer(plugins=[AmpPrecision("O1", dtype=torch.bfloat16)])       # instead of precision="bf16-mixed"
    fabric = Fabric(plugins=AmpFabricPrecision("O1", dtype=torch.float16))       # instead of precision="16-mixed"

`convert_module` converts the model IN PLACE (`amp_compiler.convert(module, level, inplace=True)`): Lightning's
DDP strategies call it and drop what it returns, so only an in-place conversion reaches the model they train.

Which modules are compiled. A LightningModule's `training_step` often calls a submodule (`self.model(x)`,
`self.encoder(x)`) and never the LightningModule's forward, so compiling its forward alone would convert
nothing. The plugin compiles each direct child with parameters instead (dynamo.compile.compile_children): a
training_step that calls `self.model(x)` runs that child's graphs, and `amp_compiler.explain(lightning_module)` /
`render` show every child's. A plain module given to Fabric is converted alone (Fabric calls its forward).

fp16 loss scaling uses this project's scaler (`amp_compiler.GradScaler`, or any `LossScaleManager` passed as
`scaler=`), in the order of Lightning's own MixedPrecision plugin: `pre_backward` (Fabric: `backward`) scales
the loss; `optimizer_step` runs the closure, unscales, runs `on_before_optimizer_step` and gradient clipping on
unscaled gradients, steps (or skips on inf/nan: the scaler all-reduces its overflow flag under DDP) and
updates (in manual optimization at the next backward: one backward may feed several optimizers' steps).
A skipped step is logged with the running count; the first one is replayed once (the closure, from the RNG
state it started with) through `amp_compiler.train.overflow_report.locate_overflow` to say where it
overflowed. There is no autocast underneath (`forward_context` is a no-op): the graphs carry the casts. bf16
has fp32's range and needs no scaler.

Level "fp8" works as any other (`AmpPrecision("fp8", fp8_scaling="delayed", ...)`). Its delayed amax histories
are in the model's state_dict; a Trainer checkpoint keeps them beside "state_dict" (under FP8_HISTORIES: Lightning
loads "state_dict" before convert_module runs) and on_load_checkpoint puts them back, so a resumed run takes the
interrupted one's next scales (a checkpoint without them warns).

After the first optimizer step (the model is captured on its first call) the explain() summary is logged;
`report_html="path.html"` writes `amp_compiler.render(model, path)` when training ends (teardown).

Strategies: single device, ddp, ddp_spawn (Trainer and Fabric). FSDP is refused by Lightning itself
(TypeError: it accepts only an FSDPPrecision subclass); DeepSpeed and ModelParallelStrategy (FSDP2/TP), which
would accept any plugin, are refused by the Trainer plugin's `convert_module` with a ValueError that names the
alternatives (Fabric's convert_module is not told the strategy: there they are untested, not refused).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import LBFGS

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.precision import Precision

import amp_compiler
from amp_compiler.dynamo.compile import compile_children
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.fp8_histories import pop_history_keys
from amp_compiler.dynamo.in_place import load_histories
from amp_compiler.train.loss_scale import LossScaleManager
from amp_compiler.train.overflow_report import locate_overflow, replay_rng, rng_state

LOW_DTYPES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
SUMMARY_LINES = 6      # explain()'s opening lines logged at fit start: header, nodes, islands
REFUSED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed casts and scales the model itself",
    "ModelParallelStrategy": "FSDP2/tensor-parallel sharding is not tested with in-place conversion",
}
FP8_HISTORIES = "amp_compiler_fp8_histories"   # a Trainer checkpoint's key for fp8 delayed amax histories
ALTERNATIVES = ('use strategy="ddp" or "ddp_spawn" with this plugin, or Lightning\'s own precision="bf16-mixed" '
                'with that strategy')


class AmpTraining:
    """What both plugins share: the conversion, the scaler, the explain log, skipped-step reports."""

    def __init__(self, level: str, dtype: torch.dtype, scaler: LossScaleManager | None,
                 report_html: str | None, convert_options: dict, logger: logging.Logger) -> None:
        if dtype not in LOW_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype!r}")
        if scaler is not None and dtype == torch.bfloat16:
            raise ValueError(f"dtype=torch.bfloat16 trains without loss scaling (bf16 has fp32's range), but "
                             f"scaler={scaler!r} was given: drop it, or use dtype=torch.float16")
        if scaler is not None and not isinstance(scaler, LossScaleManager):
            raise TypeError(f"scaler must be an amp_compiler.GradScaler or LossScaleManager (it all-reduces its "
                            f"overflow flag and reports skipped steps), got {type(scaler).__name__}")
        self.level, self.dtype, self.report_html, self.convert_options = level, dtype, report_html, convert_options
        self.scaler = scaler if scaler is not None or dtype == torch.bfloat16 else amp_compiler.GradScaler()
        self.log = logger
        self.model: nn.Module | None = None
        self.skipped_steps = 0
        self.summary_logged = False

    # -- conversion ------------------------------------------------------------------------------------------
    def convert(self, module: nn.Module) -> nn.Module:
        if compiled_record(module) is None:   # a second fit() on the same model keeps its conversion
            options = dict(self.convert_options)
            if _is_lightning_module(module):
                # training_step calls the children, never the LightningModule's forward: each child is compiled
                options.pop("freeze", None)   # dynamo's weight cache is the freeze
                if "example_inputs" in options:
                    raise ValueError("example_inputs are the LightningModule's, whose forward training_step does not "
                                     "call: its children are captured on their first calls instead")
                capture = options.pop("capture", "dynamo")
                if capture != "dynamo":
                    raise ValueError(f"capture must be 'dynamo'; got {capture!r}" +
                                     (" (the parts capture was retired)" if capture == "parts" else ""))
                compile_children(module, self.level, backend="eager", dtype=self.dtype, **options)
            else:
                amp_compiler.convert(module, self.level, inplace=True, dtype=self.dtype, **options)
        self.model = module
        return module

    # -- after a step ----------------------------------------------------------------------------------------
    def after_step(self) -> None:
        if not self.summary_logged and self.model is not None:
            self.summary_logged = True
            _log_on_rank_zero(self.log, logging.INFO, self.summary())

    def summary(self) -> str:
        lines = amp_compiler.explain(self.model).summary_lines()
        return "amp_compiler: " + "\n  ".join(lines[:SUMMARY_LINES])

    def step_overflowed(self, optimizer) -> bool:
        """Whether the scaler's step() just skipped `optimizer` (read before update() starts a new iteration)."""
        state = self.scaler._optimizer_states.get(id(optimizer), {})
        return bool(state.get("found_inf")) and self.scaler.get_drop_overflow_update()

    def report_skip(self, replay: Callable[[], Any] | None, replayed: str = "step") -> None:
        """Log a skipped step; the first one is replayed through locate_overflow to say where it overflowed."""
        self.skipped_steps += 1
        what = (f"amp_compiler: inf/nan gradients, optimizer step skipped ({self.skipped_steps} skipped so far, "
                f"loss scale {self.scaler.get_scale():g} before backing off)")
        if self.skipped_steps > 1 or replay is None:
            _log_on_rank_zero(self.log, logging.WARNING, what)
            return
        self.log.warning(f"{what}{_rank_prefix()}: {self.locate(replay, replayed)}")

    def locate(self, replay: Callable[[], Any], replayed: str) -> str:
        report = locate_overflow(self.model, replay)
        self.scaler.record_overflow(report)
        if report is not None:
            return str(report)
        return (f"the replayed {replayed} stayed finite on this rank (the overflow came from another rank, "
                "or depends on state the replay does not restore)")

    def write_report(self) -> None:
        if self.report_html and self.model is not None and compiled_record(self.model) is not None \
                and rank_zero_only.rank == 0:
            amp_compiler.render(self.model, self.report_html)

    def __repr__(self) -> str:
        return f"level={self.level!r}, dtype={self.dtype}, scaler={self.scaler!r}"


class ScalerHooks:
    """What both plugins share: their arguments, the scaler in checkpoints, the report written at teardown."""
    amp: AmpTraining
    logger_name: str   # where the plugin's lines go (beside Lightning's own)

    def __init__(self, level: str = "O1", dtype: torch.dtype = torch.bfloat16, *,
                 scaler: LossScaleManager | None = None, report_html: str | None = None,
                 **convert_options: Any) -> None:
        self.amp = AmpTraining(level, dtype, scaler, report_html, convert_options, logging.getLogger(self.logger_name))
        self.precision = LOW_DTYPES[dtype]

    @property
    def scaler(self) -> LossScaleManager | None:
        return self.amp.scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)

    def teardown(self) -> None:
        self.amp.write_report()


class AmpPrecision(ScalerHooks, Precision):
    """`Trainer(plugins=[AmpPrecision("O1", dtype=torch.bfloat16)])`: see the module docstring.

    level, dtype and the other keyword arguments go to `amp_compiler.convert`; `scaler` (fp16 only) defaults to
    `amp_compiler.GradScaler()`; `report_html` is where render() writes the model's picture at the end of fit."""
    precision = "bf16-mixed"
    logger_name = "lightning.pytorch.amp_compiler"

    def __init__(self, level: str = "O1", dtype: torch.dtype = torch.bfloat16, **options: Any) -> None:
        super().__init__(level, dtype, **options)
        self._scale_update_pending = False   # manual optimization: the scaler updates at the next backward

    def convert_module(self, module: nn.Module) -> nn.Module:
        _refuse_unsupported_strategy(module)
        return self.amp.convert(module)

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            self._update_deferred_scale()
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is not None:
            self._update_deferred_scale()   # the checkpoint holds the scale the next step uses
        return super().state_dict()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # fp8 delayed scaling: the model's state_dict holds its amax histories (dynamo/fp8_histories.py), but on
        # resume Lightning loads "state_dict" before convert_module converts the model, and the unconverted model
        # refuses their keys. They are stored beside it and loaded after the conversion (on_load_checkpoint).
        histories = pop_history_keys(checkpoint["state_dict"])
        if histories:
            checkpoint[FP8_HISTORIES] = histories

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.amp.model is not None:
            load_histories(self.amp.model, checkpoint.get(FP8_HISTORIES))

    def _update_deferred_scale(self) -> None:
        if self._scale_update_pending:
            self._scale_update_pending = False
            self.scaler.update()

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            result = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            self.amp.after_step()
            return result
        _refuse_lbfgs(optimizer)
        rng_before = rng_state()
        closure_result = closure()
        # in automatic optimization a training_step that returned None skipped backward: nothing to unscale
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            self.scaler.unscale_(optimizer)   # before the hook and clipping: they see the true gradients
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        if self.amp.step_overflowed(optimizer):
            self.amp.report_skip(_closure_replay(model, closure, rng_before), _replayed_step(model))
        if model.automatic_optimization:
            self.scaler.update()
        else:   # one manual_backward may feed several optimizers' steps: update before the next backward scales
            self._scale_update_pending = True
        self.amp.after_step()
        return step_output

    def __repr__(self) -> str:
        return f"AmpPrecision({self.amp!r})"


class AmpFabricPrecision(ScalerHooks, FabricPrecision):
    """`Fabric(plugins=AmpFabricPrecision("O1", dtype=torch.float16))`: AmpPrecision's hooks in Fabric's terms.

    Fabric has no closure: `backward` scales the loss, `optimizer_step` steps or skips and updates, and the
    first skipped step replays the last forward (its inputs, from the RNG state it started with)."""
    precision = "bf16-mixed"
    logger_name = "lightning.fabric.amp_compiler"

    def __init__(self, level: str = "O1", dtype: torch.dtype = torch.bfloat16, **options: Any) -> None:
        super().__init__(level, dtype, **options)
        self._last_call: tuple | None = None   # (inputs, RNG state) of the latest forward, for the replay

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.amp.convert(module)

    def convert_input(self, data: Any) -> Any:
        if self.scaler is not None:   # only fp16 steps are skipped and replayed
            self._last_call = (data, rng_state())
        return data

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            result = super().optimizer_step(optimizer, **kwargs)
            self.amp.after_step()
            return result
        _refuse_lbfgs(optimizer)
        step_output = self.scaler.step(optimizer, **kwargs)
        if self.amp.step_overflowed(optimizer):
            self.amp.report_skip(self._forward_replay(),
                                 "forward (Fabric has no closure: the loss and backward are the user's)")
        self.scaler.update()
        self.amp.after_step()
        return step_output

    def unscale_gradients(self, optimizer) -> None:   # fabric.clip_gradients: clip the true gradients
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def _forward_replay(self) -> Callable[[], Any] | None:
        if self._last_call is None or self.amp.model is None:
            return None
        (args, kwargs), rng = self._last_call
        model = self.amp.model   # the module itself, not Fabric's (DDP) wrapper: no collectives in the replay

        def replay():
            with replay_rng(rng):
                return model(*args, **kwargs)
        return replay

    def __repr__(self) -> str:
        return f"AmpFabricPrecision({self.amp!r})"


# -- helpers ---------------------------------------------------------------------------------------------------
def _is_lightning_module(module: nn.Module) -> bool:
    from lightning.pytorch import LightningModule
    return isinstance(module, LightningModule)


def _refuse_unsupported_strategy(module: nn.Module) -> None:
    trainer = getattr(module, "_trainer", None) if _is_lightning_module(module) else None
    strategy = type(trainer.strategy).__name__ if trainer is not None else None
    if strategy in REFUSED_STRATEGIES:
        raise ValueError(f"AmpPrecision does not support {strategy}: {REFUSED_STRATEGIES[strategy]}; "
                         f"{ALTERNATIVES}")


def _refuse_lbfgs(optimizer) -> None:
    if isinstance(optimizer, LBFGS):
        raise TypeError("LBFGS re-evaluates its closure inside step(): loss scaling cannot check its "
                        "gradients; use another optimizer, or dtype=torch.bfloat16 (no scaler)")


def _closure_replay(model, closure: Callable[[], Any], rng_before) -> Callable[[], Any] | None:
    """The closure run again from the RNG state it started with; None in manual optimization (the closure
    Lightning passes there does not run the step). Under DDP the replay skips the gradient all-reduce."""
    if not model.automatic_optimization:
        return None
    wrapper = model.trainer.strategy.model
    no_sync = wrapper.no_sync if isinstance(wrapper, nn.parallel.DistributedDataParallel) else contextlib.nullcontext

    def replay():
        with replay_rng(rng_before), no_sync():
            return closure()
    return replay


def _replayed_step(model) -> str:
    """What the replay covers: with gradient accumulation only the window's last micro-batch is replayed."""
    accumulated = getattr(model.trainer, "accumulate_grad_batches", 1)
    if accumulated > 1:
        return (f"step (only the last of the {accumulated} accumulated micro-batches: the overflow may be in an "
                "earlier one)")
    return "step"


def _log_on_rank_zero(logger: logging.Logger, level: int, message: str) -> None:
    if rank_zero_only.rank == 0:
        logger.log(level, message)


def _rank_prefix() -> str:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return f" on rank {torch.distributed.get_rank()}" if distributed else ""
