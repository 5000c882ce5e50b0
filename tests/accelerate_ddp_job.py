"""Launched by tests/integrations/test_accelerate_ddp.py as users launch: `torchrun --nproc-per-node 2 accelerate_ddp_job.py
RESULTS`. amp_compiler.accelerate.prepare under Accelerate's DDP (MULTI_CPU, gloo), one configuration after
another in the same ranks; each rank writes what it measured (RESULTS/rank{R}.json) and the test judges it.

The reference of every configuration is the same conversion in one process on the global batch (what both ranks'
batches together are at each optimizer step), computed here on each rank: DDP may change only the order of the
gradient sums and the matmuls' row counts. The clipped configuration also returns the norms
`accelerator.clip_grad_norm_` measured: unscaled, they are one process's (a skipped unscale would return them times
the loss scale)."""
from __future__ import annotations

import logging
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import amp_compiler
import amp_compiler.accelerate as amp_accelerate
from amp_testing import ProfiledDtypes
from distributed_testing import write_rank_results

PER_RANK_BATCH = 4
STEPS = 4
OVERFLOW_STEP = 1
BLOW_UP = 2.0 ** 20   # rank 1's head weight times this: its logits leave fp16's range (exact to undo)
MATMULS = ("addmm", "mm")
MAX_GRAD_NORM = 0.4   # below every step's norm here (0.68-1.08, fp16 O1): clipping acts on each step


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Linear(6, 16), nn.LayerNorm(16)
        self.hidden, self.head = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.norm(self.embed(x)))))


def dataset(accumulation: int) -> TensorDataset:
    count = STEPS * accumulation * PER_RANK_BATCH * 2
    generator = torch.Generator().manual_seed(2)   # seed 1: one-process bf16 sat 12% off fp32 (a ReLU kink), autocast 0.6%
    return TensorDataset(torch.randn(count, 6, generator=generator), torch.randint(0, 3, (count,), generator=generator))


def global_batches(data: TensorDataset, accumulation: int) -> list[tuple]:
    """Accelerate's sharded loader gives rank r the r-th batch of every two: optimizer step k reads examples
    [k * size, (k + 1) * size) over both ranks, size = 2 ranks * accumulation * PER_RANK_BATCH."""
    size = 2 * accumulation * PER_RANK_BATCH
    return [data[k * size:(k + 1) * size] for k in range(STEPS)]


def fresh_net() -> Net:
    torch.manual_seed(0)
    return Net()


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5)


def loss_of(model, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def flat(model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def one_process(level: str, dtype: torch.dtype, batches: list[tuple], skipped=(),
                max_grad_norm: float = 0.0) -> tuple[list[float], list[float]]:
    """The same conversion, one process, the global batch: plain SGD on the unscaled loss (fp16's scale is a power
    of two here, so scaling changes no rounding short of an overflow), clipped at max_grad_norm (0: not). The
    parameters at the end, and the norms clipping measured."""
    model = amp_compiler.convert(fresh_net(), level, inplace=True, dtype=dtype)
    optimizer = sgd(model)
    norms = []
    for step, (x, y) in enumerate(batches):
        if step in skipped:
            continue
        loss_of(model, x, y).backward()
        if max_grad_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return flat(model), norms


def fresh_accelerator(**options) -> Accelerator:
    AcceleratorState._reset_state(True)   # one Accelerator per configuration; the process group stays
    return Accelerator(mixed_precision="no", cpu=True, **options)


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train_under_ddp(level: str, dtype: torch.dtype, accumulation: int, overflow: bool = False,
                    max_grad_norm: float = 0.0) -> dict:
    accelerator = fresh_accelerator(gradient_accumulation_steps=accumulation)
    data = dataset(accumulation)
    model = fresh_net()
    scaler = amp_compiler.GradScaler(init_scale=2.0 ** 8) if dtype == torch.float16 else None
    prepared, optimizer, loader = amp_accelerate.prepare(
        accelerator, model, sgd(model), DataLoader(data, batch_size=PER_RANK_BATCH), level=level, dtype=dtype,
        scaler=scaler)
    rank = accelerator.process_index
    recorder, messages = ProfiledDtypes(), Messages()
    logging.getLogger("amp_compiler.accelerate").addHandler(messages)
    skipped, scales, report, unchanged_by_skip, grad_norms = [], [], None, None, []
    for micro, (x, y) in enumerate(loader):
        step = micro // accumulation
        at_overflow = overflow and step == OVERFLOW_STEP
        blow_up = at_overflow and rank == 1
        if at_overflow:
            before = flat(model)
        if blow_up:
            model.head.weight.data.mul_(BLOW_UP)
        with accelerator.accumulate(prepared):
            profiled = micro == len(loader) - 1   # graphs made by then: the profile holds no tracing
            if profiled:
                recorder.__enter__()
            accelerator.backward(loss_of(prepared, x, y))
            if profiled:
                recorder.__exit__(None, None, None)
            if max_grad_norm > 0 and accelerator.sync_gradients:   # unscales first (amp_compiler's scaler)
                grad_norms.append(float(accelerator.clip_grad_norm_(prepared.parameters(), max_grad_norm)))
            optimizer.step()
            if accelerator.sync_gradients:
                skipped.append(bool(optimizer.step_was_skipped))
                scales.append(accelerator.scaler.get_scale() if scaler is not None else None)
                if optimizer.step_was_skipped:   # every rank skips; each replays its own batch
                    report = amp_accelerate.explain_overflow(accelerator, prepared, lambda: loss_of(prepared, x, y))
            optimizer.zero_grad()
        if blow_up:
            model.head.weight.data.div_(BLOW_UP)
        if at_overflow:
            unchanged_by_skip = flat(model) == before   # every rank skipped rank 1's inf
    logging.getLogger("amp_compiler.accelerate").removeHandler(messages)
    reference, reference_norms = one_process(level, dtype, global_batches(data, accumulation),
                                             skipped=[step for step, was in enumerate(skipped) if was],
                                             max_grad_norm=max_grad_norm)
    return {"wrapped": type(prepared).__name__, "distributed_type": str(accelerator.distributed_type),
            "matmul_dtypes": sorted(str(d) for d in recorder.input_dtypes(*MATMULS)),
            "matmul_calls": sum(len(recorder.calls.get(op, ())) for op in MATMULS),
            "norm_dtypes": sorted(str(d) for d in recorder.input_dtypes("native_layer_norm")),
            "skipped": skipped, "scales": scales, "unchanged_by_skip": unchanged_by_skip,
            "report_module": None if report is None else (report.forward or report.backward or {}).get("module"),
            "messages": messages.lines, "grad_norms": grad_norms, "reference_grad_norms": reference_norms,
            "start": flat(fresh_net()), "params": flat(model), "reference": reference}


CONFIGURATIONS = {
    "bf16 O1": dict(level="O1", dtype=torch.bfloat16, accumulation=1),
    "fp16 O2, 2 micro-batches a step": dict(level="O2", dtype=torch.float16, accumulation=2),
    "fp16 O1, rank 1 overflows at step 1": dict(level="O1", dtype=torch.float16, accumulation=1, overflow=True),
    "fp16 O1, clip_grad_norm_": dict(level="O1", dtype=torch.float16, accumulation=1, max_grad_norm=MAX_GRAD_NORM),
}


def main(results_dir: str) -> None:
    torch.set_num_threads(1)
    results = {name: train_under_ddp(**options) for name, options in CONFIGURATIONS.items()}
    write_rank_results(results_dir, results)


if __name__ == "__main__":
    main(sys.argv[1])
