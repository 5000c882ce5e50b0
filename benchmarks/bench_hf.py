"""Hugging Face training step time on CPU: the frameworks' own bf16 against amp_compiler's, in their own loops.

    python benchmarks/bench_hf.py [--models bert,llama] [--steps 12] [--rounds 2] [--threads 1] [--clock cpu]

Rows, per model: the Trainer in fp32, with TrainingArguments(bf16=True) (Accelerate's autocast), and
AmpTrainer(amp_dtype=torch.bfloat16) (converted in place at O1, no autocast); Accelerate's own loop with
Accelerator(mixed_precision="no") in fp32, mixed_precision="bf16", and amp_compiler.accelerate.prepare(...,
dtype=torch.bfloat16) under mixed_precision="no". Every variant trains its own copy of the same initial model
with AdamW on the same batches. A step is one forward, backward and optimizer step (Trainer: on_step_begin to
on_step_end, so the Trainer's own bookkeeping is in it). The first two steps of a variant's first round are warm-up
(dynamo makes the in-place graphs on their first call) and not timed; the figure is the median of the timed steps over
all rounds. Accelerate keeps one process-wide state, so the variants run one after the other (each round runs them
all once), not interleaved step by step; --clock cpu (the default) reads process CPU time, which another job on
the machine disturbs less than wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import amp_compiler.models.torchvision_ops  # noqa: E402,F401  (transformers imports torchvision's C ops)
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import amp_compiler.accelerate as amp_accelerate  # noqa: E402
from amp_compiler.huggingface import AmpTrainer  # noqa: E402

WARMUP = 2
BATCH, SEQUENCE = 8, 128
TRAINER_VARIANTS = ("Trainer fp32", "Trainer bf16=True", "AmpTrainer bf16")
ACCELERATE_VARIANTS = ("Accelerate fp32", "Accelerate mixed_precision=bf16", "amp_compiler.accelerate bf16")


def build(name: str):
    """A model big enough for matmuls to matter on CPU, small enough for a benchmark of minutes."""
    torch.manual_seed(0)
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification
        return BertForSequenceClassification(BertConfig(
            vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=SEQUENCE, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQUENCE, use_cache=False))
    raise ValueError(f"unknown model {name!r}: use bert or llama")


def examples(name: str, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        ids = torch.randint(1, 1000, (SEQUENCE,), generator=generator)
        label = ids.clone() if name == "llama" else int(torch.randint(0, 4, (), generator=generator))
        rows.append({"input_ids": ids, "labels": label})
    return rows


def batches(rows: list[dict]) -> list[dict]:
    return [{key: torch.stack([torch.as_tensor(r[key]) for r in rows[i:i + BATCH]]) for key in rows[0]}
            for i in range(0, len(rows), BATCH)]


class StepClock(TrainerCallback):
    def __init__(self, clock):
        self.clock, self.times, self.started = clock, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(self.clock() - self.started)


def trainer_steps(variant: str, model, rows: list[dict], steps: int, clock) -> list[float]:
    AcceleratorState._reset_state(True)
    timer = StepClock(clock)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=BATCH,
                             max_steps=steps, save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_strategy="no", bf16=variant == "Trainer bf16=True", seed=0)
    kind = AmpTrainer if variant == "AmpTrainer bf16" else Trainer
    extra = {"amp_dtype": torch.bfloat16} if kind is AmpTrainer else {}
    kind(model=model, args=args, train_dataset=rows, callbacks=[timer], **extra).train()
    return timer.times


def accelerate_steps(variant: str, model, data: list[dict], steps: int, clock) -> list[float]:
    AcceleratorState._reset_state(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "amp_compiler.accelerate bf16":
        accelerator = Accelerator(mixed_precision="no", cpu=True)
        model, optimizer = amp_accelerate.prepare(accelerator, model, optimizer, dtype=torch.bfloat16)
    else:
        accelerator = Accelerator(mixed_precision="bf16" if "bf16" in variant else "no", cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
    times = []
    for step in range(steps):
        started = clock()
        accelerator.backward(model(**data[step % len(data)]).loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(clock() - started)
    return times


def measure(name: str, steps: int, rounds: int, clock) -> dict[str, float]:
    rows = examples(name, BATCH * steps)
    data = batches(rows)
    runs = [(variant, trainer_steps) for variant in TRAINER_VARIANTS] + \
           [(variant, accelerate_steps) for variant in ACCELERATE_VARIANTS]
    models = {variant: build(name) for variant, _ in runs}   # the same initial weights (seed 0) for each
    times: dict[str, list[float]] = {variant: [] for variant, _ in runs}
    for round_number in range(rounds):
        for variant, run in runs:
            taken = run(variant, models[variant], rows if run is trainer_steps else data, steps, clock)
            times[variant] += taken[WARMUP:] if round_number == 0 else taken
    return {variant: statistics.median(values) * 1000 for variant, values in times.items()}


def table(results: dict[str, dict[str, float]], clock_name: str) -> str:
    lines = [f"| model | variant | ms/step ({clock_name}) | vs the framework's bf16 |", "|---|---|---:|---:|"]
    for name, figures in results.items():
        for variants in (TRAINER_VARIANTS, ACCELERATE_VARIANTS):
            framework_bf16 = figures[variants[1]]
            for variant in variants:
                lines.append(f"| {name} | {variant} | {figures[variant]:.1f} | {figures[variant] / framework_bf16:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,llama")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = {name: measure(name, args.steps, args.rounds, clock) for name in args.models.split(",")}
    print(f"batch {BATCH} x {SEQUENCE} tokens, AdamW, {args.threads} thread(s), {args.steps} steps x "
          f"{args.rounds} rounds, median\n")
    print(table(results, args.clock))


if __name__ == "__main__":
    main()
