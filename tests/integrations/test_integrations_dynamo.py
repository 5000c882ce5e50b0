"""The training integrations on TorchDynamo's capture (convert options {"capture": "dynamo"}): HF's AmpTrainer and
Accelerate's prepare train a tiny BERT like fp32 with every linear low, forward and backward."""
from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import BertForSequenceClassification, Trainer

import amp_compiler
import amp_compiler.accelerate as amp_accelerate
from amp_compiler.dynamo import graphs
from amp_compiler.huggingface import AmpTrainer
from amp_compiler.passes.node_facts import facts
from amp_testing import ProfiledDtypes
from test_accelerate import batches, sgd, train_fp32
from test_hf_trainer import (FP32_OPS, RecordStep, arguments, examples, fresh_accelerator_state,  # noqa: F401
                             tiny_bert, weights)

pytestmark = pytest.mark.real_models

DYNAMO = {"capture": "dynamo"}
LINEARS = ("addmm", "mm", "mkldnn::_linear_pointwise")   # forward, backward; a cached packed linear in eval


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def linear_precisions(model) -> set:
    return {facts(n).get("precision") for gm in graphs(model) for n in gm.graph.nodes
            if facts(n).get("op") == "linear"}


def close_to(ours: dict, theirs: dict, start: dict) -> None:
    update = torch.cat([(theirs[k] - start[k]).flatten() for k in start])
    difference = torch.cat([(ours[k] - theirs[k]).flatten() for k in start])
    assert update.norm() > 0.1 and difference.norm() < 0.05 * update.norm(), (difference.norm(), update.norm())


def test_amp_trainer_on_dynamo_trains_like_fp32_with_every_linear_low_and_saves_a_plain_model(tmp_path):
    data = examples()
    reference = Trainer(model=tiny_bert(), args=arguments(tmp_path / "fp32"), train_dataset=data)
    reference.train()
    model, record = tiny_bert(), RecordStep(step=2, recorder=ProfiledDtypes())
    start = weights(model)
    trainer = AmpTrainer(model=model, args=arguments(tmp_path / "bf16"), train_dataset=data, eval_dataset=data[:8],
                         callbacks=[record], amp_dtype=torch.bfloat16, amp_options=DYNAMO)
    trainer.train()
    assert trainer.model is model and graphs(model) and linear_precisions(model) == {"low"}
    assert record.recorder.input_dtypes("addmm", "mm") == {torch.bfloat16}   # forward and backward
    assert record.recorder.input_dtypes(*FP32_OPS) == {torch.float32}
    close_to(weights(model), weights(reference.model), start)
    assert "torch.dynamo" in str(amp_compiler.explain(model))
    trainer.evaluate()
    trainer.save_model(tmp_path / "saved")
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "saved")
    assert loaded.state_dict().keys() == model.state_dict().keys()   # nothing of the conversion was saved
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights(model).items())


def test_accelerate_prepare_on_dynamo_trains_like_fp32():
    data = batches()
    reference, model = tiny_bert(), tiny_bert()
    start = weights(model)
    train_fp32(reference, data)
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    prepared, optimizer = amp_accelerate.prepare(accelerator, model, sgd(model), dtype=torch.bfloat16, **DYNAMO)
    assert prepared is model
    recorder = ProfiledDtypes()
    last = len(data) - 1   # steps 0 and 1 compile (1: dynamic shapes), and tracing's fake ops are profiled too
    for step, batch in enumerate(data):
        if step == last:
            recorder.__enter__()
        accelerator.backward(prepared(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == last:
            recorder.__exit__(None, None, None)
    assert recorder.input_dtypes("addmm", "mm") == {torch.bfloat16}
    close_to(weights(model), weights(reference), start)


def test_lightning_on_dynamo_compiles_the_children_training_step_calls_and_trains_like_bf16_mixed(tmp_path):
    from test_lightning import Classifier, fit
    from amp_compiler.lightning import AmpPrecision
    reference = Classifier()
    fit(reference, precision="bf16-mixed")
    converted = Classifier()
    converted.recorder = ProfiledDtypes()
    report = tmp_path / "report.html"
    fit(converted, plugins=[AmpPrecision("O1", dtype=torch.bfloat16, capture="dynamo", report_html=str(report))])
    assert "model" in report.read_text()   # the HTML report of the children's graphs
    for ours, theirs in zip(converted.losses, reference.losses):
        assert abs(ours - theirs) <= 2e-2 * abs(theirs), (converted.losses, reference.losses)
    assert all(converted.params_changed)
    assert converted.recorder.input_dtypes("mm", "addmm", "bmm") == {torch.bfloat16}
    assert converted.recorder.input_dtypes("native_layer_norm", "_softmax") == {torch.float32}
    text = str(amp_compiler.explain(converted))
    assert "graph 1 of model" in text and "torch.dynamo" in text
    assert linear_precisions(converted.model) == {"low"}
    amp_compiler.restore(converted)
    assert "forward" not in converted.model.__dict__
