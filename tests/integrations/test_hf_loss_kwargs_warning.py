"""AmpTrainer warns about the Trainer's loss-kwargs trap (amp_compiler/huggingface.py, loss_kwargs_trap): a forward
taking **kwargs whose loss ignores num_items_in_batch steps (accumulation x world size) times what one process
on the global batch steps. One process here, 2 micro-batches a step unless said; the trap under 2 ranks is
tests/integrations/test_hf_trainer_ddp.py's strict xfail (measured 4.00x)."""
from __future__ import annotations

import logging

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                          TrainingArguments)

from amp_compiler.huggingface import AmpTrainer

pytestmark = pytest.mark.real_models


class NetTakingKwargs(nn.Module):
    """Its forward takes **kwargs (so the Trainer passes num_items_in_batch) and returns the batch-mean loss."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, labels=None, **kwargs):
        logits = self.head(torch.relu(self.hidden(x)))
        if labels is None:   # a compute_loss_func takes the labels
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


class NetTakingKwargsNotLossKwargs(NetTakingKwargs):
    accepts_loss_kwargs = False   # the fix the warning names


class NetDividingByNumItems(NetTakingKwargs):
    """Uses num_items_in_batch and says so: the Trainer's attribute is the model's word."""
    accepts_loss_kwargs = True

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        logits = super().forward(x)["logits"]
        return {"loss": nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / num_items_in_batch}


def net_examples(count: int = 16) -> list[dict]:
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(count, 6, generator=generator), torch.randint(0, 3, (count,), generator=generator)
    return [{"x": x[i], "labels": int(y[i])} for i in range(count)]


def token_examples(count: int = 16, labels_are_tokens: bool = False) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32, (count, 8), generator=generator)
    classes = torch.randint(0, 3, (count,), generator=generator)
    return [{"input_ids": ids[i], "labels": ids[i] if labels_are_tokens else int(classes[i])} for i in range(count)]


def tiny_llama() -> LlamaForCausalLM:   # its forward passes **kwargs to self.loss_function: it uses num_items_in_batch
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


def tiny_bert() -> BertForSequenceClassification:   # computes CrossEntropyLoss() itself: ignores num_items_in_batch
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=16, num_labels=3))


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(True)


def warnings_of_training(tmp_path, model, data, accumulation: int = 2, steps: int = 1, **trainer_options) -> list[str]:
    """Train `steps` optimizer steps with AmpTrainer (bf16 O1); the amp_compiler warnings about loss kwargs."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulation, max_steps=steps, optim="sgd",
                             learning_rate=0.1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    trainer_log = logging.getLogger("transformers.amp_compiler")   # transformers' loggers do not propagate
    trainer_log.addHandler(handler)
    try:
        trainer = AmpTrainer(model=model, args=args, train_dataset=data, amp_dtype=torch.bfloat16, **trainer_options)
        trainer.train()
    finally:
        trainer_log.removeHandler(handler)
    assert trainer.state.global_step == steps   # it trained: no warning below is for want of a step
    return [line for line in lines if "num_items_in_batch" in line]


def test_a_model_that_ignores_num_items_in_batch_is_warned_about_once_with_the_factor_and_the_fix(tmp_path):
    warned = warnings_of_training(tmp_path, NetTakingKwargs(), net_examples(), steps=2)
    assert len(warned) == 1, warned
    assert "NetTakingKwargs" in warned[0] and "2x" in warned[0] and "accepts_loss_kwargs = False" in warned[0]


def test_transformers_own_head_that_computes_a_batch_mean_loss_is_warned_about(tmp_path):
    # BertForSequenceClassification's forward takes **kwargs but calls CrossEntropyLoss() itself: with the plain
    # Trainer, 2 micro-batches step 2.00x one batch of 8 (measured, first SGD step)
    warned = warnings_of_training(tmp_path, tiny_bert(), token_examples())
    assert len(warned) == 1 and "BertForSequenceClassification" in warned[0], warned


@pytest.mark.parametrize("case", ["a PreTrainedModel passing num_items_in_batch to its loss",
                                  "accepts_loss_kwargs = False", "accepts_loss_kwargs = True", "one micro-batch on one process",
                                  "a compute_loss_func"])
def test_no_warning_where_the_loss_is_right(tmp_path, case):
    model, data, options, accumulation = NetTakingKwargs(), net_examples(), {}, 2
    if case.startswith("a PreTrainedModel"):
        model, data = tiny_llama(), token_examples(labels_are_tokens=True)
    elif case == "accepts_loss_kwargs = False":
        model = NetTakingKwargsNotLossKwargs()
    elif case == "accepts_loss_kwargs = True":
        model = NetDividingByNumItems()
    elif case.startswith("one micro-batch"):
        accumulation = 1
    else:   # the Trainer gives num_items_in_batch to the function, which is the user's to use
        options["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: \
            nn.functional.cross_entropy(outputs["logits"].float(), labels, reduction="sum") / num_items_in_batch
    assert warnings_of_training(tmp_path, model, data, accumulation, **options) == []
