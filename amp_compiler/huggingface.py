"""The Hugging Face Trainer with amp-compiler's graphs instead of its autocast: `AmpTrainer`, a Trainer subclass.

    trainer = AmpTrainer(model=model, args=TrainingArguments(..., bf16=False, fp16=False),   # instead of Trainer
                         train_dataset=..., amp_level="O1", amp_dtype=torch.float16)
    trainer.train()

Everything else is the Trainer's: gradient accumulation, clipping, evaluation, save_model, checkpoints and
resume_from_checkpoint. `class MyTrainer(AmpTrainerMixin, SFTTrainer)` does the same for a Trainer subclass;
`Trainer(..., callbacks=[AmpCallback("O1", dtype=torch.bfloat16)])` does bf16 with the Trainer class unchanged
(a callback cannot reach the accelerator, so it cannot scale an fp16 loss: AmpTrainer does fp16).

- The model is converted IN PLACE (`amp_compiler.convert(model, amp_level, inplace=True, dtype=amp_dtype)`), so
  it keeps its class, `forward` signature (the Trainer reads `inspect.signature(model.forward)` to keep the
  dataset's columns), parameters and state_dict: `save_model` writes what a plain `from_pretrained` loads.
  A `model_init` model is converted when the Trainer builds it.
- There is no autocast underneath: TrainingArguments must keep `bf16=False, fp16=False` (the default). Either
  flag would make Accelerate run its autocast or torch GradScaler on top of the converted graphs, so it is refused
  with a ValueError that says to pass `amp_dtype=` instead.
- fp16 trains with amp_compiler's scaler (`amp_compiler.GradScaler()` unless `amp_scaler=` gives one), installed
  as the Trainer's `accelerator.scaler` (amp_compiler/accelerate.py): `accelerator.backward` scales the loss,
  `clip_grad_norm_` unscales first, the prepared optimizer's step skips inf/nan gradients, the Trainer then leaves
  the learning-rate schedule where it was (`optimizer_step_was_skipped`), and the Trainer's own checkpointing saves
  the scaler's state_dict as `scaler.pt` in each checkpoint and loads it on resume.
- A skipped fp16 step is logged with the running count; the first one is replayed (the last micro-batch of the
  accumulation window, from the RNG state it started with, with the scale the step used) through
  `amp_compiler.train.overflow_report.locate_overflow`, which names the node that went inf/nan first; the report
  is logged and recorded on the scaler (`trainer.amp_overflow_report`).
- The Trainer's loss-kwargs trap is warned about, once, at the first micro-batch that has labels: a forward taking
  `**kwargs` makes the Trainer pass `num_items_in_batch` and then neither divide the loss by the accumulation steps
  nor (with `average_tokens_across_devices`, the default) keep it from being multiplied by the world size. A model
  whose loss ignores num_items_in_batch then steps (accumulation x world size) times what one process on the global
  batch steps. AmpTrainer trains as the plain Trainer does (it changes nothing) but warns, naming the model class
  and the fix (`accepts_loss_kwargs = False` on the model), when the model has no `accepts_loss_kwargs` attribute,
  no `compute_loss_func` is given, that factor is above 1, and the model is not a PreTrainedModel whose forward
  passes its **kwargs on to `self.loss_function` (many of transformers' own heads, BertForSequenceClassification
  among them, compute their loss without it: they are warned about too).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import re
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import unwrap_peft_model

from amp_compiler.accelerate import (check_distributed, checked_scaler, convert_once, install_scaler,
                                     locate_and_record, refuse_builtin_mixed_precision, replay_gradient_sync)
from amp_compiler.train.loss_scale import LossScaleManager
from amp_compiler.train.overflow_report import replay_rng, rng_state

log = logging.getLogger("transformers.amp_compiler")


class AmpTrainerMixin:
    """Put before a Trainer class: `class MyTrainer(AmpTrainerMixin, Trainer)`; see the module docstring.

    amp_level, amp_dtype and amp_options (a dict) go to `amp_compiler.convert`; amp_scaler (fp16 only) defaults
    to `amp_compiler.GradScaler()`."""

    def __init__(self, model=None, args=None, *trainer_args: Any, amp_level: str = "O1",
                 amp_dtype: torch.dtype = torch.bfloat16, amp_scaler: LossScaleManager | None = None,
                 amp_options: dict | None = None, **trainer_kwargs: Any) -> None:
        if args is not None:
            _refuse_trainer_mixed_precision(args)
        self.amp_level, self.amp_dtype, self.amp_options = amp_level, amp_dtype, dict(amp_options or {})
        self.amp_scaler = checked_scaler(amp_scaler, amp_dtype)
        self.amp_skipped_steps = 0
        self.amp_overflow_report = None
        self._amp_last_micro_batch = None   # what the first skipped step replays
        self._amp_loss_kwargs_checked = False
        if model is not None:
            convert_once(model, amp_level, amp_dtype, self.amp_options)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if self.amp_scaler is not None:
            self.add_callback(_SkippedStepWatch(self))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()   # also called again by auto_find_batch_size
        refuse_builtin_mixed_precision(self.accelerator.mixed_precision,
                                       "TrainingArguments(bf16=False, fp16=False) with AmpTrainer")
        check_distributed(self.accelerator)   # DeepSpeed and FSDP1 refused; FSDP2 with the level's policy
        if self.amp_scaler is not None:
            install_scaler(self.accelerator, self.amp_scaler)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        convert_once(model, self.amp_level, self.amp_dtype, self.amp_options)
        return model

    def training_step(self, model, inputs, num_items_in_batch=None):
        if num_items_in_batch is not None and not self._amp_loss_kwargs_checked:
            self._amp_loss_kwargs_checked = True
            warning = loss_kwargs_trap(self)
            if warning:
                log.warning(warning)
        if self.amp_scaler is not None and self.amp_skipped_steps == 0:
            self._amp_last_micro_batch = (model, inputs, num_items_in_batch, rng_state(), self.amp_scaler.get_scale())
        return super().training_step(model, inputs, num_items_in_batch)

    def amp_step_skipped(self) -> None:
        """Log a skipped fp16 step; replay the first one to say where it overflowed."""
        self.amp_skipped_steps += 1
        if self.amp_skipped_steps > 1 or self._amp_last_micro_batch is None:
            log.warning(f"amp_compiler: inf/nan gradients, optimizer step skipped ({self.amp_skipped_steps} skipped "
                        f"so far, loss scale now {self.amp_scaler.get_scale():g})")
            return
        model, inputs, num_items_in_batch, rng, scale = self._amp_last_micro_batch
        self._amp_last_micro_batch = None

        def replay():   # the Trainer's own training_step, scaled as the skipped step was (DDP: no all-reduce)
            with replay_rng(rng), _scaled_by(self.accelerator, scale), replay_gradient_sync(self.accelerator, model):
                super(AmpTrainerMixin, self).training_step(model, inputs, num_items_in_batch)
        self.amp_overflow_report = locate_and_record(self.accelerator.unwrap_model(model), replay,
                                                     self.amp_scaler, log)


def loss_kwargs_trap(trainer) -> str | None:
    """What the Trainer (transformers 5.x) does to a loss-kwargs model's loss, when the model ignores the
    num_items_in_batch it is passed: a warning naming the model and the fix, or None. Read for a micro-batch
    whose num_items_in_batch the Trainer counted (labels in the batch): Trainer.compute_loss and training_step."""
    model = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if (not trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None
            or hasattr(model, "accepts_loss_kwargs") or _loss_uses_num_items_in_batch(model)):
        return None
    args = trainer.args
    # loss_is_scaled_for_ga None (the default) counts a loss-kwargs model's loss as divided already
    undivided = args.gradient_accumulation_steps if trainer.loss_is_scaled_for_ga is not False else 1
    multiplied = 1
    if args.average_tokens_across_devices:   # compute_loss multiplies the loss by this
        multiplied = trainer.accelerator.num_processes // trainer.get_tp_size() if args.n_gpu <= 1 else args.n_gpu
    if undivided * multiplied == 1:
        return None
    name = type(model).__name__
    return (f"amp_compiler: {name}.forward takes **kwargs, so the Trainer passes it num_items_in_batch and then "
            f"leaves its loss undivided by the {undivided} accumulation step(s) and multiplied by {multiplied} "
            f"(average_tokens_across_devices, {trainer.accelerator.num_processes} processes); {name}'s loss does "
            f"not use num_items_in_batch, so each optimizer step moves {undivided * multiplied}x what one process "
            f"on the global batch moves (the plain Trainer does the same; AmpTrainer changes nothing). Fix: set "
            f"`accepts_loss_kwargs = False` on {name} (a class attribute, or on the model before the Trainer is "
            f"built), or divide its loss by num_items_in_batch")


_PASSES_KWARGS_TO_LOSS = re.compile(r"loss_function\((?:[^()]|\([^()]*\))*\*\*\w*kwargs", re.S)


def _loss_uses_num_items_in_batch(model) -> bool:
    """transformers' own heads that honour num_items_in_batch pass forward's **kwargs to self.loss_function
    (LlamaForCausalLM, GPT2LMHeadModel, ViTForImageClassification); others compute a batch-mean loss themselves
    (BertForSequenceClassification, Llama's and GPT-2's sequence classifiers). A model that is not a
    PreTrainedModel is taken to ignore it: the Trainer's own `accepts_loss_kwargs` is how it says otherwise."""
    if not isinstance(model, PreTrainedModel):
        return False
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):   # no source to read: give transformers' model the benefit of the doubt
        return True
    return "num_items_in_batch" in source or bool(_PASSES_KWARGS_TO_LOSS.search(source))


class AmpTrainer(AmpTrainerMixin, Trainer):
    """`transformers.Trainer` training amp_compiler's converted model: see the module docstring."""


class AmpCallback(TrainerCallback):
    """`Trainer(..., callbacks=[AmpCallback("O1", dtype=torch.bfloat16)])`: bf16 with the Trainer class unchanged.

    Converts the Trainer's model in place when the Trainer is built (on_init_end). bf16 only: fp16 needs the
    loss scaled inside `accelerator.backward`, and callbacks are not given the accelerator; use AmpTrainer (or
    AmpTrainerMixin) for fp16, and for `model_init=` models (the Trainer does not give callbacks the model it
    builds in train())."""

    def __init__(self, level: str = "O1", dtype: torch.dtype = torch.bfloat16, **convert_options: Any) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(f"AmpCallback trains bf16 only (dtype={dtype!r}): fp16 needs loss scaling inside "
                             "accelerator.backward, which a callback cannot reach; use "
                             "AmpTrainer(..., amp_dtype=torch.float16) instead of Trainer(...)")
        self.level, self.dtype, self.convert_options = level, dtype, convert_options

    def on_init_end(self, args, state, control, model=None, **kwargs):
        _refuse_trainer_mixed_precision(args)
        if model is None:
            raise ValueError("AmpCallback found no model when the Trainer was built (model_init=?): use "
                             "AmpTrainer(model_init=..., amp_dtype=torch.bfloat16), which converts the model it builds")
        convert_once(model, self.level, self.dtype, self.convert_options)


class _SkippedStepWatch(TrainerCallback):
    """Right after the optimizer step: was it skipped (inf/nan gradients)?"""

    def __init__(self, trainer: AmpTrainerMixin) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.accelerator.optimizer_step_was_skipped:
            self.trainer.amp_step_skipped()


def _refuse_trainer_mixed_precision(args) -> None:
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False):
            raise ValueError(f"TrainingArguments({flag}=True) turns on Accelerate's autocast/GradScaler, which would "
                             f"run on top of amp_compiler's converted graphs: set {flag}=False and choose the "
                             f"precision with AmpTrainer(amp_dtype=torch.{'bfloat16' if flag == 'bf16' else 'float16'})")


class _FixedScale:
    """What accelerator.backward needs of a scaler, at one fixed scale and with no state: for the replay."""

    def __init__(self, scale: float) -> None:
        self.value = scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.value


@contextlib.contextmanager
def _scaled_by(accelerator, scale: float):
    scaler = accelerator.scaler
    accelerator.scaler = _FixedScale(scale)
    try:
        yield
    finally:
        accelerator.scaler = scaler
