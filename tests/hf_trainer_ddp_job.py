"""Launched by tests/integrations/test_hf_trainer_ddp.py as users launch: `torchrun --nproc-per-node 2 hf_trainer_ddp_job.py
RESULTS`. amp_compiler.huggingface.AmpTrainer under the Trainer's own DDP (Accelerate MULTI_CPU, gloo), one
configuration after another in the same ranks; each rank writes what it measured (RESULTS/rank{R}.json) and the
test judges it.

The reference of every configuration is the same conversion in one process on the global batch (what both ranks'
batches together are at each optimizer step), computed here on each rank. The model's forward takes no **kwargs, so
the Trainer neither passes num_items_in_batch nor multiplies the loss by the world size: its loss is the batch mean,
divided by the accumulation steps, and DDP averages the ranks' gradients. A clipped fp16 configuration meets one
process clipped at the same norm, and logs the norms clipping measured (unscaled: a skipped unscale would log them
times the scale); AmpCallback (the Trainer class unchanged) trains bf16 under the same DDP. The last configurations
measure what happens when the forward does take **kwargs (the Trainer's model_accepts_loss_kwargs): no reference
to meet, a ratio to report, and AmpTrainer's warning about it."""
from __future__ import annotations

import logging
import os
import sys
import tempfile

# the model zoo's torchvision_ops, before transformers imports torchvision (as tests/conftest.py does)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.torchvision_ops  # noqa: E402,F401
import torch  # noqa: E402
from accelerate.state import AcceleratorState
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import amp_compiler
from amp_compiler.huggingface import AmpCallback, AmpTrainer
from amp_testing import ProfiledDtypes
from distributed_testing import write_rank_results

PER_RANK_BATCH = 4
STEPS = 4
OVERFLOW_STEP = 1
BLOW_UP = 2.0 ** 20   # rank 1's head weight times this: its logits leave fp16's range (exact to undo)
MATMULS = ("addmm", "mm")
LEARNING_RATE = 0.5
MAX_GRAD_NORM = 0.4   # below every step's norm here (0.68-1.08): clipping acts on each step. At 0.5 one process's
# fp16 step 2 sat on a kink (its gradient 6% off fp32 from the same parameters; DDP's 6e-4)


class Net(nn.Module):
    """No **kwargs in forward: the Trainer's num_items_in_batch logic stays out (model_accepts_loss_kwargs=False)."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Linear(6, 16), nn.LayerNorm(16)
        self.hidden, self.head = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x, labels=None):
        logits = self.head(torch.relu(self.hidden(self.norm(self.embed(x)))))
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


class NetTakingKwargs(Net):
    """The same model, but its forward takes (and ignores) **kwargs, as many Hub models' do."""

    def forward(self, x, labels=None, **kwargs):
        return super().forward(x, labels)


class NetTakingKwargsNotLossKwargs(NetTakingKwargs):
    """The remedy a user has: the Trainer reads this attribute before it looks at forward's signature."""
    accepts_loss_kwargs = False


def examples(accumulation: int) -> list[dict]:
    count = STEPS * accumulation * PER_RANK_BATCH * 2
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(count, 6, generator=generator), torch.randint(0, 3, (count,), generator=generator)
    return [{"x": x[i], "labels": int(y[i])} for i in range(count)]


def global_batches(data: list[dict], accumulation: int) -> list[tuple]:
    """A sequential sampler sharded by Accelerate gives rank r the r-th batch of every two: optimizer step k reads
    examples [k * size, (k + 1) * size) over both ranks, size = 2 ranks * accumulation * PER_RANK_BATCH."""
    size = 2 * accumulation * PER_RANK_BATCH
    chunks = [data[k * size:(k + 1) * size] for k in range(STEPS)]
    return [(torch.stack([e["x"] for e in chunk]), torch.tensor([e["labels"] for e in chunk])) for chunk in chunks]


def fresh_net(kind=Net) -> Net:
    torch.manual_seed(0)
    return kind()


def flat(model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def one_process(level: str, dtype: torch.dtype, batches: list[tuple], skipped=(),
                max_grad_norm: float = 0.0) -> tuple[list[list[float]], list[float]]:
    """The same conversion, one process, the global batch: plain SGD on the unscaled mean loss (fp16's scale is a
    power of two here, so scaling changes no rounding short of an overflow), clipped at max_grad_norm (0: not).
    The parameters after each step, and the norms clipping measured."""
    model = amp_compiler.convert(fresh_net(), level, inplace=True, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    after_each, norms = [], []
    for step, (x, y) in enumerate(batches):
        if step not in skipped:
            model(x, y)["loss"].backward()
            if max_grad_norm > 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            optimizer.step()
            optimizer.zero_grad()
        after_each.append(flat(model))
    return after_each, norms


class Watch(TrainerCallback):
    """Per optimizer step: skipped or not, the scale, the parameters; profiles the last step (its graphs were made
    by then, so the profile holds no tracing); at `overflow_step` multiplies rank 1's head weight by BLOW_UP for
    the step's forward and backward, and divides it back after the replay that says where it overflowed."""

    def __init__(self, trainer_model, rank: int, overflow_step: int | None):
        self.model, self.rank, self.overflow_step = trainer_model, rank, overflow_step
        self.recorder = ProfiledDtypes()
        self.skipped, self.scales, self.after_each, self.unchanged_by_skip = [], [], [], None
        self.trainer = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == STEPS - 1:
            self.recorder.__enter__()
        if state.global_step == self.overflow_step:
            self.before = flat(self.model)
            if self.rank == 1:
                self.model.head.weight.data.mul_(BLOW_UP)

    def on_optimizer_step(self, args, state, control, **kwargs):   # before AmpTrainer's own watch replays
        if state.global_step == STEPS - 1:
            self.recorder.__exit__(None, None, None)
        self.skipped.append(bool(self.trainer.accelerator.optimizer_step_was_skipped))
        scaler = getattr(self.trainer, "amp_scaler", None)   # a plain Trainer with AmpCallback has none
        self.scales.append(None if scaler is None else scaler.get_scale())

    def on_step_end(self, args, state, control, **kwargs):   # global_step is the step just done, plus one
        if state.global_step - 1 == self.overflow_step:
            if self.rank == 1:
                self.model.head.weight.data.div_(BLOW_UP)
            self.unchanged_by_skip = flat(self.model) == self.before   # every rank skipped rank 1's inf
        self.after_each.append(flat(self.model))


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def arguments(output_dir: str, accumulation: int, max_grad_norm: float) -> TrainingArguments:
    return TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=PER_RANK_BATCH,
                             gradient_accumulation_steps=accumulation, max_steps=STEPS, optim="sgd",
                             learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=max_grad_norm,
                             train_sampling_strategy="sequential", save_strategy="no", report_to=[],
                             ddp_find_unused_parameters=False,   # True (the default here) walks the graph again
                             logging_steps=1, disable_tqdm=True, seed=0)


def build_trainer(args: TrainingArguments, model, data, watch, level, dtype, scaler, callback: bool):
    if callback:   # the Trainer class unchanged: bf16 only
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[watch, AmpCallback(level, dtype)])
    return AmpTrainer(model=model, args=args, train_dataset=data, callbacks=[watch], amp_level=level,
                      amp_dtype=dtype, amp_scaler=scaler)


def train_under_ddp(level: str, dtype: torch.dtype, accumulation: int, overflow: bool = False,
                    kind=Net, max_grad_norm: float = 0.0, callback: bool = False) -> dict:
    AcceleratorState._reset_state(True)   # one Accelerator per Trainer; the process group stays
    data = examples(accumulation)
    model = fresh_net(kind)
    scaler = amp_compiler.GradScaler(init_scale=2.0 ** 8) if dtype == torch.float16 else None
    rank = int(os.environ["RANK"])   # torchrun sets it; the Trainer joins the process group later
    watch = Watch(model, rank, OVERFLOW_STEP if overflow else None)
    messages = Messages()
    trainer_log = logging.getLogger("transformers.amp_compiler")   # transformers' loggers do not propagate
    trainer_log.addHandler(messages)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(arguments(output_dir, accumulation, max_grad_norm), model, data, watch, level,
                                dtype, scaler, callback)
        watch.trainer = trainer
        trainer.train()
    trainer_log.removeHandler(messages)
    explained = amp_compiler.explain(trainer.model)
    reference, reference_norms = one_process(level, dtype, global_batches(data, accumulation),
                                             skipped=[step for step, was in enumerate(watch.skipped) if was],
                                             max_grad_norm=max_grad_norm)
    report = getattr(trainer, "amp_overflow_report", None)
    return {"trainer": type(trainer).__name__, "wrapped": type(trainer.model_wrapped).__name__,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
            "explained_matmuls": sorted({row["dtype"] for row in explained.rows if row["family"] == "matmul"}),
            "explained_matmul_rows": sum(row["family"] == "matmul" for row in explained.rows),
            "matmul_dtypes": sorted(str(d) for d in watch.recorder.input_dtypes(*MATMULS)),
            "matmul_calls_per_micro_batch": sum(len(watch.recorder.calls.get(op, ())) for op in MATMULS)
            / accumulation,
            "norm_dtypes": sorted(str(d) for d in watch.recorder.input_dtypes("native_layer_norm")),
            "skipped": watch.skipped, "scales": watch.scales, "unchanged_by_skip": watch.unchanged_by_skip,
            "report_module": None if report is None else (report.forward or report.backward or {}).get("module"),
            "messages": messages.lines, "start": flat(fresh_net()), "params": flat(model),
            "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
            "reference_grad_norms": reference_norms,
            "after_first_step": watch.after_each[0], "reference": reference[-1],
            "reference_after_first_step": reference[0]}


CONFIGURATIONS = {
    "bf16 O1": dict(level="O1", dtype=torch.bfloat16, accumulation=1),
    "fp16 O2, 2 micro-batches a step": dict(level="O2", dtype=torch.float16, accumulation=2),
    "fp16 O1, rank 1 overflows at step 1": dict(level="O1", dtype=torch.float16, accumulation=1, overflow=True),
    "fp16 O1, clipped at max_grad_norm": dict(level="O1", dtype=torch.float16, accumulation=1,
                                              max_grad_norm=MAX_GRAD_NORM),
    "bf16 O1, AmpCallback on the plain Trainer": dict(level="O1", dtype=torch.bfloat16, accumulation=1,
                                                      callback=True),
    # measured, not met: transformers scales this loss by the world size and leaves it undivided by accumulation
    "bf16 O1, forward takes **kwargs, 2 micro-batches a step": dict(level="O1", dtype=torch.bfloat16,
                                                                     accumulation=2, kind=NetTakingKwargs),
    "bf16 O1, forward takes **kwargs, accepts_loss_kwargs = False, 2 micro-batches a step": dict(
        level="O1", dtype=torch.bfloat16, accumulation=2, kind=NetTakingKwargsNotLossKwargs),
}


def main(results_dir: str) -> None:
    torch.set_num_threads(1)
    results = {name: train_under_ddp(**options) for name, options in CONFIGURATIONS.items()}
    write_rank_results(results_dir, results)


if __name__ == "__main__":
    main(sys.argv[1])
