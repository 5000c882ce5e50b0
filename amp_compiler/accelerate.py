"""Hugging Face Accelerate with amp-compiler's graphs instead of Accelerate's autocast: a recipe.

    accelerator = Accelerator(mixed_precision="no")                 # no autocast underneath: the graphs cast
    model, optimizer, loader = amp_compiler.accelerate.prepare(     # instead of accelerator.prepare(...)
        accelerator, model, optimizer, loader, level="O1", dtype=torch.float16)
    ...
    accelerator.backward(loss)          # fp16: scales the loss with amp_compiler's scaler
    accelerator.clip_grad_norm_(...)    # unscales first, as Accelerate's own fp16 does
    optimizer.step()                    # unscales, skips on inf/nan (optimizer.step_was_skipped), updates the scale

Accelerate has no hook for a third-party model transformation, so the recipe works around `prepare`: it
converts the model IN PLACE (`amp_compiler.convert(model, level, inplace=True, dtype=...)`: same object, class,
forward signature and state_dict, so Accelerate's saving, unwrapping and DDP wrapping see the user's model),
then calls `accelerator.prepare`. For fp16 it installs the scaler (`amp_compiler.GradScaler()` unless one is
given) as `accelerator.scaler` BEFORE the optimizer is prepared, which is where Accelerate's own fp16 keeps its
torch GradScaler:

- `accelerator.backward(loss)` calls `scaler.scale(loss).backward()`;
- the prepared optimizer's `step()` calls `scaler.step(optimizer)` and `scaler.update()` and says the step was
  skipped (`optimizer.step_was_skipped`, `accelerator.optimizer_step_was_skipped`) when the optimizer's own
  step was not called, which is exactly what amp_compiler's scaler does on inf/nan gradients;
- `accelerator.save_state` / `load_state` write and read `accelerator.scaler`'s state_dict (scaler.pt).
  The scaler is therefore NOT also passed to `register_for_checkpointing`: that would save it twice.

One thing Accelerate does only for its own fp16 is patched on the accelerator instance: `unscale_gradients`
(called by `clip_grad_norm_` / `clip_grad_value_`) unscales only when `mixed_precision="fp16"`; here it unscales
with the installed scaler, so clipping sees the true gradients. `backward` is wrapped to remember the scale it
used, for `explain_overflow`.

When a step was skipped, `explain_overflow(accelerator, model, compute_loss)` replays the step's forward and
backward (`compute_loss()` recomputes the loss of that batch) with the scale the step used, node by node, and
says which node went inf/nan first (`amp_compiler.train.overflow_report`); the report is logged and recorded on
the scaler. The replay runs under a forked RNG (training's random stream is untouched; dropout draws new masks).

DeepSpeed is refused (its engine runs backward and loss scaling itself). DDP (`torchrun --nproc-per-node N
script.py`) is tested on gloo: the scaler all-reduces its overflow flag, so every rank skips together; call
explain_overflow on every rank (no collective: each replays its own batch): the rank whose batch overflowed logs
where, the others log that theirs stayed finite.

FSDP2 (`Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...), mixed_precision="no")`, and
the HF Trainer's `fsdp="full_shard", fsdp_config={"version": 2}`): Accelerate shards the converted model in prepare
(fully_shard per auto-wrap-policy module, its own embedding/final-norm groups for HF models, then the root).
`check_distributed` wraps the accelerator's prepare so each fully_shard gets the level's MixedPrecisionPolicy
(train/fsdp_policy.py: fp32 gathers and reduction at O0-O2 and fp8, low gathers with an fp32 reduction at O3)
when the plugin sets none; a plugin policy that contradicts the level (a low param_dtype where the level keeps
weights fp32, an fp16 reduction) is refused, naming it. The plugin is left as given. The sharded model is then
compiled per block at once (dynamo.compile.compile_per_block), as its first sharded call would be. FSDP1
(fsdp_version=1) is refused. On CPU Accelerate drops the plugin and wraps in DDP (MULTI_CPU): the suite runs the
FSDP2 path on 2 gloo ranks with the accelerator state set to what a GPU machine's holds
(tests/integrations/test_accelerate_fsdp.py: bf16 O1 and O3, fp16 O2 with the scaler and gradient accumulation, an fp16
overflow on one rank); on GPUs it runs only through `python benchmarks/gpu_fsdp.py`. One rank's inf skips the step on every rank; explain_overflow
(on every rank) replays with FSDP2's gradient reduction, since gradients left unsynced stay unsharded past zero_grad
and would poison the next step; a rank that computed nothing non-finite says the overflow came from another rank.
save_state/load_state under FSDP2 are not tested.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch import nn

import amp_compiler
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.compile import CompiledForward, hand_over_histories, compile_per_block, \
    fsdp_module_type, fsdp_sharded_submodule, history_stores, restore_compiled
from amp_compiler.train.fsdp_policy import level_mp_policy, policy_contradiction
from amp_compiler.train.loss_scale import LossScaleManager
from amp_compiler.train.overflow_report import locate_overflow, replay_rng

LOW_DTYPES = (torch.bfloat16, torch.float16)
log = logging.getLogger("amp_compiler.accelerate")


def prepare(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, *others: Any, level: str = "O1",
            dtype: torch.dtype = torch.bfloat16, scaler: LossScaleManager | None = None, **convert_options: Any):
    """Convert `model` in place, install the fp16 scaler, then `accelerator.prepare(model, optimizer, *others)`.

    Returns what `accelerator.prepare` returns (the prepared objects, in order). `convert_options` go to
    `amp_compiler.convert` (e.g. force_fp32=[...]); `scaler` (fp16 only) defaults to `amp_compiler.GradScaler()`.
    """
    refuse_builtin_mixed_precision(accelerator.mixed_precision, "Accelerator(mixed_precision=\"no\")")
    check_distributed(accelerator)
    scaler = checked_scaler(scaler, dtype)
    _refuse_prepared_optimizer(optimizer)
    convert_once(model, level, dtype, convert_options)
    if scaler is not None:
        install_scaler(accelerator, scaler)
    return accelerator.prepare(model, optimizer, *others)


# -- what the Trainer integration shares ---------------------------------------------------------------------
def refuse_builtin_mixed_precision(mixed_precision: str, fix: str) -> None:
    """Accelerate's own mixed precision would run autocast (bf16) or a torch GradScaler (fp16) on top of the
    converted graphs: two mixed precisions, the outer one undoing the inner one's fp32 choices."""
    if str(mixed_precision) != "no":
        raise ValueError(f"Accelerate's mixed_precision is {str(mixed_precision)!r}: amp_compiler converts the "
                         f"model itself, and Accelerate's autocast/GradScaler would run on top of it; use {fix} "
                         "and choose the precision with dtype=")


def check_distributed(accelerator) -> None:
    """DeepSpeed and FSDP1 refused; under FSDP2 the accelerator's prepare shards with the level's policy."""
    from accelerate.utils import DistributedType
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("DeepSpeed casts and scales the model itself (its fp16/bf16 config): amp_compiler's "
                         "conversion is not supported under it; use DDP or FSDP2, or DeepSpeed's own mixed precision")
    if accelerator.distributed_type == DistributedType.FSDP:
        if accelerator.state.fsdp_plugin.fsdp_version != 2:
            raise ValueError("FSDP1 (FullyShardedDataParallelPlugin(fsdp_version=1), the default) wraps the model in "
                             "flat parameters, which the in-place conversion is not tested on: use "
                             "FullyShardedDataParallelPlugin(fsdp_version=2) (TrainingArguments: "
                             "fsdp_config={\"version\": 2}), or DDP")
        shard_with_level_policy(accelerator)


# -- FSDP2 (fsdp_version=2) -----------------------------------------------------------------------------------
def shard_with_level_policy(accelerator) -> None:
    """Make `accelerator.prepare` (which FSDP2 shards the model in: fully_shard per auto-wrap-policy module, then
    the root) shard a converted model with its level's MixedPrecisionPolicy, then compile it per block.

    The plugin's own mixed_precision_policy is used only when it agrees with the level (a contradicting one is
    refused, naming it); unset, the level's is used for that prepare and the plugin left as it was."""
    if getattr(accelerator.prepare, "shards_with_level_policy", False):
        return   # a second prepare() or Trainer on this accelerator: wrapped once
    prepare = accelerator.prepare

    def prepare_with_level_policy(*args, **kwargs):
        converted = [obj for obj in args if isinstance(obj, nn.Module) and compiled_record(obj) is not None]
        if not converted:
            return prepare(*args, **kwargs)
        plugin = accelerator.state.fsdp_plugin
        given = plugin.mixed_precision_policy
        plugin.mixed_precision_policy = level_policy_for(given, compiled_record(converted[0]).config)
        try:
            result = prepare(*args, **kwargs)
        finally:
            used, plugin.mixed_precision_policy = plugin.mixed_precision_policy, given   # the user's plugin as it was
        for model in converted:   # FSDP2 shards in place: the same objects come back
            compile_sharded_model(model, gathers_low=used.param_dtype not in (None, torch.float32))
        return result
    prepare_with_level_policy.shards_with_level_policy = True
    accelerator.prepare = prepare_with_level_policy


def level_policy_for(given, config):
    """The MixedPrecisionPolicy FSDP2 shards with: the level's (train/fsdp_policy.py) when the plugin sets none,
    the plugin's when it agrees with the level."""
    expected = level_mp_policy(config.level, config.low_dtype)
    if given is None:
        return expected
    why = policy_contradiction(given, config.level, config.low_dtype)
    if why is not None:
        raise ValueError(f"amp_compiler.accelerate: the FSDP plugin's mixed_precision_policy {given} {why}; leave "
                         f"FullyShardedDataParallelPlugin(mixed_precision_policy=...) unset (amp_compiler then shards "
                         f"with the level's {expected}) or pass that one")
    return given


def compile_sharded_model(model: nn.Module, gathers_low: bool) -> None:
    """A converted model FSDP2 just sharded: when blocks of it are sharded, compiled per block now, as its first
    sharded call would (dynamo.compile._sharded_call), so the fp8 amax stores a checkpoint loads into are the ones
    training uses and O3's low gathers are not taken for low weights; a model sharded at its root alone keeps its
    whole-model graph (FSDP2 gathers every weight before that forward)."""
    forward = compiled_record(model)
    if isinstance(forward, CompiledForward) and fsdp_sharded_submodule(model) is not None:
        histories = forward.fp8_histories.tensors if forward.fp8_histories is not None else {}
        restore_compiled(model)
        compile_per_block(model, forward.config, forward.options,
                          note=f"compiled per block: its submodule {fsdp_sharded_submodule(model)} is sharded with "
                               "FSDP2 (fully_shard) by Accelerate")
        hand_over_histories(histories, history_stores(model))
    if gathers_low:   # O3: the graphs see bf16/fp16 unsharded weights on purpose, the fp32 shards stay the masters
        for compiled in compiled_record(model).forwards(model):
            compiled.weights_cast_low = True


def checked_scaler(scaler: LossScaleManager | None, dtype: torch.dtype) -> LossScaleManager | None:
    """The scaler fp16 trains with (amp_compiler.GradScaler() by default); None for bf16."""
    if dtype not in LOW_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype!r}")
    if dtype == torch.bfloat16:
        if scaler is not None:
            raise ValueError(f"dtype=torch.bfloat16 trains without loss scaling (bf16 has fp32's range), but "
                             f"scaler={scaler!r} was given: drop it, or use dtype=torch.float16")
        return None
    if scaler is None:
        return amp_compiler.GradScaler()
    if not isinstance(scaler, LossScaleManager):
        raise TypeError(f"scaler must be an amp_compiler.GradScaler or LossScaleManager (it refuses fp16 gradients "
                        f"and reports skipped steps), got {type(scaler).__name__}")
    return scaler


def convert_once(model: nn.Module, level: str, dtype: torch.dtype, convert_options: dict) -> None:
    """Convert in place (on TorchDynamo), unless the model already is (a second prepare or Trainer keeps its
    conversion)."""
    conversion = compiled_record(model)
    if conversion is None:
        amp_compiler.convert(model, level, inplace=True, dtype=dtype, **convert_options)
    elif conversion.config.low_dtype != dtype:   # fp16 graphs trained without a scaler, or bf16 ones with one
        raise ValueError(f"the model is already converted in place to {conversion.config.low_dtype}, but "
                         f"dtype={dtype} was asked for: pass dtype={conversion.config.low_dtype}, or "
                         "amp_compiler.restore(model) first")


def install_scaler(accelerator, scaler: LossScaleManager) -> None:
    """Make `scaler` the accelerator's loss scaler: backward scales, prepared optimizers step through it,
    clipping unscales with it, save_state/load_state keep its state."""
    if accelerator._optimizers:
        raise RuntimeError("install the scaler before the optimizer is prepared: a prepared optimizer keeps the "
                           "scaler it was prepared with (None here), so its step() would neither unscale nor skip")
    accelerator.scaler = scaler
    accelerator.unscale_gradients = _unscaling_with(accelerator, scaler)
    accelerator.backward = _backward_remembering_scale(accelerator, scaler)
    accelerator._amp_scale_used = scaler.get_scale()


def _unscaling_with(accelerator, scaler: LossScaleManager) -> Callable:
    from accelerate.optimizer import AcceleratedOptimizer

    def unscale_gradients(optimizer=None):
        """Accelerate's unscale_gradients with amp_compiler's scaler (Accelerate's runs only for its own fp16)."""
        optimizers = accelerator._optimizers if optimizer is None else \
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            scaler.unscale_(opt)
    return unscale_gradients


def _backward_remembering_scale(accelerator, scaler: LossScaleManager) -> Callable:
    backward = accelerator.backward   # the bound method of the accelerator's class

    def remembering_backward(loss, **kwargs):
        accelerator._amp_scale_used = scaler.get_scale()   # the step's scale, before update() moves it
        return backward(loss, **kwargs)
    return remembering_backward


def _refuse_prepared_optimizer(optimizer) -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    if isinstance(optimizer, AcceleratedOptimizer):
        raise ValueError("the optimizer was already passed to accelerator.prepare(): pass the plain optimizer to "
                         "amp_compiler.accelerate.prepare instead, which prepares it after installing the scaler")


# -- where a skipped step overflowed --------------------------------------------------------------------------
def explain_overflow(accelerator, model: nn.Module, compute_loss: Callable[[], torch.Tensor]):
    """Replay a skipped fp16 step and say where it went inf/nan: an OverflowReport (logged, and recorded on the
    scaler), or None when the replay stayed finite.

    `compute_loss()` recomputes the skipped step's loss on the same batch (e.g. `lambda: model(**batch).loss`);
    its backward is run here with the scale that step used. Call it after `optimizer.step()` when
    `optimizer.step_was_skipped` is True."""
    scaler = accelerator.scaler
    if not isinstance(scaler, LossScaleManager):
        raise ValueError("explain_overflow needs the fp16 scaler that amp_compiler.accelerate.prepare installs "
                         f"(accelerator.scaler is {type(scaler).__name__})")
    scale = accelerator._amp_scale_used / accelerator.gradient_accumulation_steps

    def replay():
        with replay_gradient_sync(accelerator, model):
            (compute_loss().float() * scale).backward()
    with replay_rng():   # from where the stream is (compute_loss is the user's); training's stream untouched
        return locate_and_record(accelerator.unwrap_model(model), replay, scaler, log)


def replay_gradient_sync(accelerator, model: nn.Module):
    """DDP: no all-reduce (every rank skipped the step and replays its own batch; the replay's gradients sit in
    .grad, which the loop's zero_grad clears). FSDP2 reduces them instead (every rank replays, so its collectives
    match): gradients left unsynced stay unsharded past zero_grad and join the next step's (measured: the step after
    a replayed one was skipped too)."""
    return contextlib.nullcontext() if accelerator.is_fsdp2 else accelerator.no_sync(model)


def locate_and_record(model: nn.Module, replay: Callable[[], Any], scaler: LossScaleManager,
                      logger: logging.Logger):
    """locate_overflow(model, replay); the report is logged here and recorded on the scaler."""
    report = _own_overflow(locate_overflow(model, replay), model)
    scaler.record_overflow(report)   # None is recorded too: no stale report
    rank = _this_rank()
    if report is None:
        another_rank = f"another rank's batch (DDP averages the gradients, FSDP reduces them, so every rank skips; " \
            f"the rank whose batch overflowed logs where), " if rank else ""
        logger.warning(f"amp_compiler: fp16 step skipped{rank}, but its replay stayed finite (the overflow was in "
                       f"{another_rank}another micro-batch of the gradient accumulation window, or depends on state "
                       "the replay does not restore, e.g. dropout masks)")
        return None
    logger.warning(f"amp_compiler: fp16 step skipped{rank} (loss scale {scaler.get_scale():g} after backing off): "
                   f"{report}")
    return report


def _own_overflow(report, model: nn.Module):
    """None for a sharded model's replay in which nothing this rank computed went non-finite: FSDP2's replay
    reduces gradients (replay_gradient_sync), and another rank's inf reached only this rank's parameter gradients."""
    sharded_type = fsdp_module_type()
    sharded = sharded_type is not None and (isinstance(model, sharded_type) or fsdp_sharded_submodule(model))
    if report is not None and report.forward is None and report.backward is None and sharded:
        return None
    return report


def _this_rank() -> str:
    """' on rank R of N' under torch.distributed with several processes, '' in one process."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f" on rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""
