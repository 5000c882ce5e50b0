"""amp_compiler.accelerate.prepare: a tiny BERT through Accelerate's own loop on CPU, bf16 and fp16.

References: the same model in fp32 under Accelerator(mixed_precision="no") on the same batches (SGD, no
dropout); fp16 injects an overflow into one step (the classifier's weight times 2**20, exact to undo)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import amp_compiler
import amp_compiler.accelerate as amp_accelerate
import amp_compiler.dynamo
from amp_testing import ProfiledDtypes
from test_hf_trainer import FP32_OPS, LOW_OPS, examples, fresh_accelerator_state, tiny_bert, weights  # noqa: F401

pytestmark = pytest.mark.real_models

STEPS = 3
OVERFLOW_STEP = 1
BLOW_UP = 2.0 ** 20     # the classifier's logits leave fp16's range


def batches(count: int = STEPS, size: int = 4) -> list[dict]:
    rows = examples(count * size)
    return [{"input_ids": torch.stack([r["input_ids"] for r in rows[i:i + size]]),
             "labels": torch.tensor([r["labels"] for r in rows[i:i + size]])} for i in range(0, len(rows), size)]


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5)


def train_fp32(model, data) -> None:
    optimizer = sgd(model)
    for batch in data:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_bf16_converts_in_place_and_trains_like_fp32():
    data = batches()
    reference, model = tiny_bert(), tiny_bert()
    start = weights(model)
    train_fp32(reference, data)
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    prepared, optimizer = amp_accelerate.prepare(accelerator, model, sgd(model), dtype=torch.bfloat16)
    assert prepared is model and accelerator.scaler is None
    recorder = ProfiledDtypes()   # a dispatch mode would make dynamo run the model under autocast instead
    for step, batch in enumerate(data):
        with recorder if step == 2 else contextlib.nullcontext():   # step 1 recompiles: step 0 set problem_type
            accelerator.backward(prepared(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    assert recorder.input_dtypes(*LOW_OPS) == {torch.bfloat16}
    assert recorder.input_dtypes(*FP32_OPS) == {torch.float32}
    assert amp_compiler.dynamo.graphs(model)   # the converted graphs ran, not an autocast fallback
    ours, theirs = weights(model), weights(reference)
    update = torch.cat([(theirs[k] - start[k]).flatten() for k in start])
    difference = torch.cat([(ours[k] - theirs[k]).flatten() for k in start])
    assert update.norm() > 0.1 and difference.norm() < 0.05 * update.norm()


def test_fp16_skips_the_overflowing_step_says_where_and_checkpoints_the_scaler(tmp_path):
    data = batches()
    model = tiny_bert()
    fp32_model = copy.deepcopy(model)
    fp32_model(**data[0]).loss.backward()
    fp32_norm = torch.nn.utils.clip_grad_norm_(fp32_model.parameters(), float("inf"))
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    model, optimizer = amp_accelerate.prepare(accelerator, model, sgd(model), dtype=torch.float16)
    scaler = accelerator.scaler
    assert isinstance(scaler, amp_compiler.GradScaler) and optimizer.scaler is scaler

    skipped, scales, norms, report = [], [], [], None
    for step, batch in enumerate(data):
        if step == OVERFLOW_STEP:
            before = weights(model)
            model.classifier.weight.data.mul_(BLOW_UP)
        accelerator.backward(model(**batch).loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 100.0)))   # unscales first
        optimizer.step()
        skipped.append(optimizer.step_was_skipped)
        scales.append(scaler.get_scale())
        if optimizer.step_was_skipped:
            report = amp_accelerate.explain_overflow(accelerator, model, lambda: model(**batch).loss)
        optimizer.zero_grad()
        if step == OVERFLOW_STEP:
            model.classifier.weight.data.div_(BLOW_UP)
            assert all(torch.equal(weights(model)[k], v) for k, v in before.items())   # nothing was stepped

    assert skipped == [False, True, False] and accelerator.optimizer_step_was_skipped is False
    assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    assert abs(norms[0] - float(fp32_norm)) < 0.02 * float(fp32_norm)   # clipping saw unscaled gradients
    assert report is not None and report.forward["module"] == "classifier" and scaler.last_overflow_report is report

    accelerator.save_state(tmp_path)
    saved = scaler.state_dict()
    assert (tmp_path / "scaler.pt").exists()
    scaler.update(new_scale=3.0)
    accelerator.load_state(tmp_path)
    assert scaler.state_dict() == saved and scaler.get_scale() == 2.0 ** 15


def test_accelerates_own_mixed_precision_a_wrong_scaler_and_another_dtype_are_refused():
    model = tiny_bert()
    with pytest.raises(ValueError, match='mixed_precision="no"'):
        amp_accelerate.prepare(Accelerator(mixed_precision="bf16", cpu=True), model, sgd(model))
    AcceleratorState._reset_state(True)
    with pytest.raises(ValueError, match="without loss scaling"):
        amp_accelerate.prepare(Accelerator(mixed_precision="no", cpu=True), model, sgd(model),
                               dtype=torch.bfloat16, scaler=amp_compiler.GradScaler())
    assert "_amp_compiled" not in model.__dict__
    amp_compiler.convert(model, "O1", inplace=True, dtype=torch.float16)   # lazy: nothing captured yet
    with pytest.raises(ValueError, match="already converted in place to torch.float16"):
        amp_accelerate.prepare(Accelerator(mixed_precision="no", cpu=True), model, sgd(model), dtype=torch.bfloat16)
