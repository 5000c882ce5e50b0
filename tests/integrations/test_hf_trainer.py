"""amp_compiler.huggingface.AmpTrainer: a tiny BERT through transformers' Trainer on CPU, bf16 and fp16.

References: the plain Trainer in fp32 on the same weights and batches (SGD, no dropout: the updates compare
directly), the uninterrupted fp16 run for resume_from_checkpoint, and a plain from_pretrained for save_model."""
from __future__ import annotations

import inspect
import logging

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments)

import amp_compiler
from amp_compiler.huggingface import AmpCallback, AmpTrainer
from amp_compiler.converted import compiled_record
from amp_testing import ProfiledDtypes

pytestmark = pytest.mark.real_models

LOW_OPS = ("addmm", "mm")                                       # the Linear layers, forward and backward
FP32_OPS = ("native_layer_norm", "_safe_softmax", "_softmax", "_log_softmax", "nll_loss_forward")


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def examples(count: int = 32, seed: int = 1) -> list[dict]:
    """A list of dicts, as a datasets-free train_dataset."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (8,), generator=generator),
             "labels": int(torch.randint(0, 3, (), generator=generator))} for _ in range(count)]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state; each Trainer here builds its own Accelerator. One intra-op
    thread: on 2 busy cores, torch's thread pool made these tiny matmuls 3-6x slower."""
    AcceleratorState._reset_state(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(True)


def arguments(output_dir, **overrides) -> TrainingArguments:
    settings = dict(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=4,
                    per_device_eval_batch_size=8, gradient_accumulation_steps=2, max_steps=4, optim="sgd",
                    learning_rate=0.5, lr_scheduler_type="constant", save_strategy="no", report_to=[],
                    logging_steps=1, disable_tqdm=True, seed=0)
    return TrainingArguments(**{**settings, **overrides})


def weights(model) -> dict:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


class RecordStep(TrainerCallback):
    """Records the ATen calls of one optimizer step: its micro-batches' forward and backward (with `recorder`, a
    context manager with input_dtypes(); ProfiledDtypes by default: a dispatch mode would make dynamo run the
    model under autocast instead)."""

    def __init__(self, step: int, recorder=None):
        self.step, self.recorder = step, recorder if recorder is not None else ProfiledDtypes()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.recorder.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.recorder.__exit__(None, None, None)


@pytest.mark.parametrize("way", ["AmpTrainer", "AmpCallback"])
def test_bf16_trains_like_fp32_with_matmuls_low_and_saves_a_plain_model(tmp_path, way):
    data = examples()
    reference = Trainer(model=tiny_bert(), args=arguments(tmp_path / "fp32"), train_dataset=data,
                        eval_dataset=data[:8])
    reference.train()
    record = RecordStep(step=2)   # after the first step captured the graphs
    model = tiny_bert()
    start = weights(model)
    if way == "AmpTrainer":
        trainer = AmpTrainer(model=model, args=arguments(tmp_path / "bf16"), train_dataset=data,
                             eval_dataset=data[:8], callbacks=[record], amp_dtype=torch.bfloat16)
    else:
        trainer = Trainer(model=model, args=arguments(tmp_path / "bf16"), train_dataset=data, eval_dataset=data[:8],
                          callbacks=[record, AmpCallback("O1", dtype=torch.bfloat16)])
    trainer.train()

    assert trainer.model is model and trainer.accelerator.scaler is None     # no autocast, no scaler under bf16
    # the Trainer keeps the dataset columns model.forward's signature names: the conversion kept it
    assert inspect.signature(model.forward) == inspect.signature(BertForSequenceClassification.forward.__get__(model))
    assert record.recorder.input_dtypes(*LOW_OPS) == {torch.bfloat16}
    assert record.recorder.input_dtypes(*FP32_OPS) == {torch.float32}
    assert compiled_record(model) is not None and compiled_record(model).converter.graphs   # graphs, no fallback
    ours, theirs = weights(model), weights(reference.model)
    update = torch.cat([(theirs[k] - start[k]).flatten() for k in start])
    difference = torch.cat([(ours[k] - theirs[k]).flatten() for k in start])
    assert update.norm() > 0.1 and difference.norm() < 0.05 * update.norm()
    ours_eval, fp32_eval = trainer.evaluate()["eval_loss"], reference.evaluate()["eval_loss"]
    assert abs(ours_eval - fp32_eval) < 0.02 * fp32_eval

    trainer.save_model(tmp_path / "saved")
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "saved")
    assert type(loaded.forward).__name__ == "method"    # a plain model: nothing of the conversion was saved
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.items())


def test_fp16_skips_overflowing_steps_says_where_and_resumes_with_the_scalers_state(tmp_path, caplog):
    data = examples()
    # the first step overflows fp16 at 2**40 and backs off to 2**10, where the next steps are clean
    model = tiny_bert()
    uninterrupted = AmpTrainer(model=model, args=arguments(tmp_path, save_strategy="steps", save_steps=2),
                               train_dataset=data, amp_dtype=torch.float16, amp_scaler=_scaler())
    trainer_log = logging.getLogger("transformers.amp_compiler")   # transformers' loggers do not propagate
    trainer_log.addHandler(caplog.handler)
    try:
        uninterrupted.train()
    finally:
        trainer_log.removeHandler(caplog.handler)
    final_weights, final_scaler = weights(model), uninterrupted.amp_scaler.state_dict()
    assert final_scaler["loss_scale"] == 2.0 ** 10 and final_scaler["clean_steps"] == 3
    assert uninterrupted.amp_skipped_steps == 1
    # the clean steps clipped unscaled gradients (scaled ones would measure ~2**10 times more)
    norms = [entry["grad_norm"] for entry in uninterrupted.state.log_history if "grad_norm" in entry]
    assert len(norms) == 4 and all(0 < norm < 20 for norm in norms[1:])
    report = uninterrupted.amp_overflow_report   # fp16 gradients overflowed, nearest the loss in the classifier
    assert report is not None and report.forward is None and report.backward["module"] == "classifier"
    assert uninterrupted.amp_scaler.last_overflow_report is report
    assert str(report).splitlines()[0] in caplog.text
    checkpoint = tmp_path / "checkpoint-2"
    assert torch.load(checkpoint / "scaler.pt")["loss_scale"] == 2.0 ** 10

    # resumed: a fresh scaler (2**40) takes the checkpoint's state, so steps 3-4 are clean as in the full run
    resumed = AmpTrainer(model=model, args=arguments(tmp_path, save_strategy="steps", save_steps=2),
                         train_dataset=data, amp_dtype=torch.float16, amp_scaler=_scaler())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.amp_scaler.state_dict() == final_scaler and resumed.amp_skipped_steps == 0
    assert all(torch.allclose(weights(model)[k], v, rtol=1e-5, atol=1e-6) for k, v in final_weights.items())


def _scaler() -> amp_compiler.GradScaler:
    return amp_compiler.GradScaler(init_scale=2.0 ** 40, backoff_factor=2.0 ** -30)


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_the_trainers_own_mixed_precision_is_refused(tmp_path, flag):
    model = tiny_bert()
    with pytest.raises(ValueError, match=f"{flag}=False"):
        AmpTrainer(model=model, args=arguments(tmp_path, **{flag: True}), amp_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{flag}=False"):
        Trainer(model=model, args=arguments(tmp_path, **{flag: True}), callbacks=[AmpCallback()])
    assert "_amp_compiled" not in model.__dict__   # refused before converting anything


def test_the_callback_refuses_fp16_and_names_amp_trainer():
    with pytest.raises(ValueError, match="AmpTrainer"):
        AmpCallback("O1", dtype=torch.float16)


def test_a_model_init_model_is_converted_when_the_trainer_builds_it(tmp_path):
    trainer = AmpTrainer(model_init=lambda: tiny_bert(), args=arguments(tmp_path), amp_dtype=torch.float16)
    conversion = compiled_record(trainer.model)
    assert conversion is not None and conversion.config.low_dtype == torch.float16
    assert isinstance(trainer.accelerator.scaler, amp_compiler.GradScaler)
