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

Strategies: single device, ddp, ddp_spawn (Trainer and Fabric), and ModelParallelStrategy with FSDP2
(`fully_shard` in the LightningModule's `configure_model`, over one mesh dimension). Lightning runs
configure_model before convert_module, so the blocks are sharded when the model is converted: a LightningModule
with a sharded submodule is compiled per block at once (dynamo.compile.compile_per_block: each sharded block and
each submodule with parameters and no sharded block in it compiled on its own, FSDP's unshard/reshard around each
block's graph; the modules holding blocks run as written), not on its first call, so the fp8 amax stores a
checkpoint loads into are the ones training uses. `plugin.mp_policy` is the level's FSDP2 MixedPrecisionPolicy
(README's table: fp32 gathers at O0-O2 and fp8, low gathers with an fp32 reduction at O3); a policy that
contradicts it (a low param_dtype where the level keeps weights fp32, an fp16 gradient reduction) is refused.
Tensor parallelism (DTensor parameters outside fully_shard, or a 2-D mesh) is refused: untested.
Under ModelParallelStrategy one rank's inf skips the step on every rank (the scaler all-reduces its flag); the
replay runs on every rank (FSDP's all-gathers are collectives) with the gradient reduction, and a rank whose
replay stayed finite says so instead of naming the gradients other ranks' inf reached it through.
Checkpoints there are DCP folders: the scaler's state and the fp8 histories go to the folder's metadata file
(rank 0's), the histories per rank (FP8_HISTORIES_BY_RANK: each rank records its own batches' amaxes) and kept
out of the model's state_dict (DCP refuses keys that are no attributes of the model).
FSDP (`strategy="fsdp"`, FSDP1) accepts only an FSDPPrecision: use `AmpFSDPPrecision` (the same plugin, with
FSDP1's MixedPrecision from the level). Lightning runs FSDP1 on GPUs only: that path is untested here beyond
Lightning accepting it. DeepSpeed is refused by the Trainer plugin's `convert_module` with a ValueError that names
the alternatives (Fabric's convert_module is not told the strategy: there it is untested, not refused).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import LBFGS

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision

import amp_compiler
from amp_compiler.config import make_config, with_model_lists
from amp_compiler.dynamo.compile import compile_children, compile_per_block, fsdp_module_type, \
    fsdp_sharded_submodule, history_stores
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.fp8_histories import pop_history_keys
from amp_compiler.dynamo.in_place import load_histories
from amp_compiler.train.fsdp_policy import GATHERS_LOW, level_mp_policy, policy_contradiction
from amp_compiler.train.loss_scale import LossScaleManager
from amp_compiler.train.overflow_report import locate_overflow, replay_rng, rng_state

LOW_DTYPES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
SUMMARY_LINES = 6      # explain()'s opening lines logged at fit start: header, nodes, islands
REFUSED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed casts and scales the model itself",
}
FP8_HISTORIES = "amp_compiler_fp8_histories"   # a Trainer checkpoint's key for fp8 delayed amax histories
FP8_HISTORIES_BY_RANK = "amp_compiler_fp8_histories_by_rank"   # [rank 0's, rank 1's, ...] when several ranks save
ALTERNATIVES = ('use strategy="ddp", "ddp_spawn" or ModelParallelStrategy with FSDP2 (fully_shard) with this '
                'plugin, or Lightning\'s own precision="bf16-mixed" with that strategy')


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
                _refuse_tensor_parallel(module)
                sharded = fsdp_sharded_submodule(module)
                if sharded is None:
                    compile_children(module, self.level, backend="eager", dtype=self.dtype, **options)
                else:   # configure_model sharded its blocks (ModelParallelStrategy) before convert_module
                    self.convert_sharded(module, sharded, options)
            else:
                amp_compiler.convert(module, self.level, inplace=True, dtype=self.dtype, **options)
        self.model = module
        return module

    def convert_sharded(self, module: nn.Module, sharded: str, options: dict) -> None:
        """A LightningModule whose submodule `sharded` FSDP2 shards: compiled per block now, as its first sharded
        call would (dynamo.compile._sharded_call), so the fp8 amax stores a resumed checkpoint loads into are
        those training uses. Each fully_shard's MixedPrecisionPolicy is checked against the level's first."""
        _refuse_contradicting_policies(module, self.level, self.dtype, self.mp_policy())
        if "calibration_data" in options:
            raise ValueError("calibration_data: the samples are the model's inputs, but a LightningModule's "
                             "blocks are compiled one by one; convert the module its training_step calls first "
                             "(convert(module.model, level, inplace=True, calibration_data=...)), then shard it")
        compile_options = {"backend": "eager", "dynamic": options.pop("dynamic", None),
                           "weight_cache": options.pop("weight_cache", True)}
        config = with_model_lists(make_config(self.level, dtype=self.dtype, **options), module)
        compile_per_block(module, config, compile_options,
                          note=f"compiled per block: its submodule {sharded} is sharded with FSDP2 (fully_shard)")
        for _, store in history_stores(module):
            store.in_state_dict = False   # DCP's get_model_state_dict refuses them: saved apart (on_save_checkpoint)
        if _gathers_low(module):   # O3's low gathers: the graphs see bf16/fp16 unsharded weights on purpose, the
            for forward in compiled_record(module).forwards(module):   # fp32 shards stay the masters (no warning)
                forward.weights_cast_low = True

    def mp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this level (README's table): fp32 gathers and reduction where the
        graphs keep weights fp32 (norms) and cast the others themselves; at O3 low gathers, an fp32 reduction."""
        return level_mp_policy(self.level, self.dtype)

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
        if report is not None and report.forward is None and report.backward is None \
                and fsdp_sharded_submodule(self.model) is not None:
            # FSDP2's replay reduces gradients across ranks (its collectives run on every rank): another rank's
            # inf reached this rank's parameter gradients there, and nothing this rank computed went non-finite
            self.scaler.record_overflow(None)
            return (f"the replayed {replayed} stayed finite on this rank ({len(report.parameters)} parameter "
                    "gradient(s) became non-finite in FSDP's gradient reduction: the overflow came from another rank)")
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

    @property
    def mp_policy(self):
        """The level's FSDP2 MixedPrecisionPolicy: `fully_shard(block, mesh=..., mp_policy=plugin.mp_policy)` in
        configure_model (`self.trainer.precision_plugin.mp_policy`)."""
        return self.amp.mp_policy()

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
        return Precision.pre_backward(self, tensor, module)   # not FSDPPrecision's (AmpFSDPPrecision): it scales too

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is not None:
            self._update_deferred_scale()   # the checkpoint holds the scale the next step uses
        return super().state_dict()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # fp8 delayed scaling: the model's state_dict holds its amax histories (dynamo/fp8_histories.py), but on
        # resume Lightning loads "state_dict" before convert_module converts the model, and the unconverted model
        # refuses their keys. They are stored beside it and loaded after the conversion (on_load_checkpoint).
        # Sharded (ModelParallelStrategy) they are kept out of the state_dict and read from the stores. Each rank
        # records its own batches' amaxes, and a distributed checkpoint's metadata is rank 0's: every rank's are
        # gathered (on_save_checkpoint runs on every rank, as Trainer.save_checkpoint must be called).
        histories = pop_history_keys(checkpoint["state_dict"])
        if not histories and self.amp.model is not None:
            histories = _stored_histories(self.amp.model)
        if histories:
            checkpoint[FP8_HISTORIES] = histories
        # only where the conversion keeps histories (the same on every rank): other saves run no collective
        by_rank = _gathered_by_rank(histories) if self.amp.model is not None and history_stores(self.amp.model) \
            else None
        if by_rank is not None and any(by_rank):
            checkpoint[FP8_HISTORIES_BY_RANK] = by_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.amp.model is not None:
            load_histories(self.amp.model, _own_histories(checkpoint))

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


class AmpFSDPPrecision(AmpPrecision, FSDPPrecision):
    """`Trainer(strategy="fsdp", plugins=[AmpFSDPPrecision("O1", dtype=torch.bfloat16)])`: AmpPrecision for
    Lightning's FSDPStrategy (FSDP1), which accepts only an FSDPPrecision. FSDP1's MixedPrecision comes from the
    level (`mixed_precision_config`: fp32 parameters, reduction and buffers, low parameters at O3), not from
    FSDPPrecision's bf16/fp16 reduction; no autocast (forward_context), the loss scaled once (AmpPrecision's
    scaler). Lightning runs FSDPStrategy on GPUs only: untested here beyond Lightning accepting the plugin."""
    logger_name = "lightning.pytorch.amp_compiler"

    def __init__(self, level: str = "O1", dtype: torch.dtype = torch.bfloat16, **options: Any) -> None:
        super().__init__(level, dtype, **options)
        self._desired_input_dtype = torch.float32   # FSDPPrecision's inputs and init dtype: fp32 masters

    @property
    def mixed_precision_config(self):
        from torch.distributed.fsdp import MixedPrecision
        param_dtype = self.amp.dtype if self.amp.level in GATHERS_LOW else torch.float32
        return MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

    def forward_context(self):   # FSDPPrecision's is torch.autocast: the graphs carry the casts
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"AmpFSDPPrecision({self.amp!r})"


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


def _refuse_tensor_parallel(module: nn.Module) -> None:
    """ModelParallelStrategy's tensor parallelism (a DTensor parameter no fully_shard manages, or one on a 2-D
    mesh: FSDP2 with TP, or HSDP) is refused: the in-place graphs are untested on such parameters."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:   # never imported: no parameter is a DTensor (and a single-device fit pays no import)
        return
    sharded_type = fsdp_module_type()
    managed = {id(p) for m in module.modules() if sharded_type is not None and isinstance(m, sharded_type)
               for p in m.parameters()}
    for name, parameter in module.named_parameters():
        if isinstance(parameter, dtensor.DTensor) and (id(parameter) not in managed or parameter.device_mesh.ndim > 1):
            raise ValueError(f"AmpPrecision: parameter {name} is a DTensor on a {parameter.device_mesh.ndim}-D mesh "
                             f"{'' if id(parameter) in managed else 'that no fully_shard manages '}(tensor "
                             "parallelism or HSDP), which is untested with in-place conversion; shard with FSDP2 "
                             "over one mesh dimension: ModelParallelStrategy(data_parallel_size=<devices>, "
                             "tensor_parallel_size=1) and fully_shard(block, mesh=self.device_mesh['data_parallel'])")


def _refuse_contradicting_policies(module: nn.Module, level: str, dtype: torch.dtype, expected) -> None:
    """Each fully_shard's MixedPrecisionPolicy against the level's (README's table)."""
    sharded_type = fsdp_module_type()
    for path, sharded in module.named_modules():
        if not isinstance(sharded, sharded_type):
            continue
        policy = sharded._get_fsdp_state()._mp_policy   # FSDP2 keeps no public getter for it
        why = policy_contradiction(policy, level, dtype)
        if why is not None:
            raise ValueError(f"AmpPrecision: {path or type(module).__name__} is sharded with {policy}, which {why}; "
                             f"pass mp_policy=self.trainer.precision_plugin.mp_policy ({expected}) to fully_shard "
                             "in configure_model")


def _gathers_low(module: nn.Module) -> bool:
    """Whether a fully_shard of `module` gathers its parameters in a low dtype (MixedPrecisionPolicy.param_dtype)."""
    sharded_type = fsdp_module_type()
    return any(sharded._get_fsdp_state()._mp_policy.param_dtype not in (None, torch.float32)
               for sharded in module.modules() if isinstance(sharded, sharded_type))


def _stored_histories(model: nn.Module) -> dict:
    """The fp8 amax histories of `model`'s stores, under their state_dict keys (CPU copies)."""
    return {f"{prefix}{key}.{name}": tensor.detach().cpu().clone() for prefix, store in history_stores(model)
            for key, tensors in store.tensors.items() for name, tensor in tensors.items()}


def _gathered_by_rank(histories: dict) -> list | None:
    """Every rank's `histories`, by rank, where several ranks train; None in one process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return None
    by_rank: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(by_rank, {key: value.cpu() for key, value in histories.items()})
    return by_rank


def _own_histories(checkpoint: dict) -> dict | None:
    """This rank's fp8 amax histories from a checkpoint: its own where several ranks saved theirs."""
    by_rank = checkpoint.get(FP8_HISTORIES_BY_RANK)
    if by_rank is None:
        return checkpoint.get(FP8_HISTORIES)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world, rank = (torch.distributed.get_world_size(), torch.distributed.get_rank()) if distributed else (1, 0)
    if world != len(by_rank):
        raise ValueError(f"the checkpoint holds the fp8 amax histories of {len(by_rank)} ranks, this run has {world}: "
                         "each rank's are its own (its batches' amaxes); resume on as many ranks as saved it")
    return by_rank[rank]


def _refuse_lbfgs(optimizer) -> None:
    if isinstance(optimizer, LBFGS):
        raise TypeError("LBFGS re-evaluates its closure inside step(): loss scaling cannot check its "
                        "gradients; use another optimizer, or dtype=torch.bfloat16 (no scaler)")


def _closure_replay(model, closure: Callable[[], Any], rng_before) -> Callable[[], Any] | None:
    """The closure run again from the RNG state it started with; None in manual optimization (the closure
    Lightning passes there does not run the step). Under DDP the replay skips the gradient all-reduce; under FSDP2
    it runs on every rank with the reduction (the forward's all-gathers are collectives too)."""
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
