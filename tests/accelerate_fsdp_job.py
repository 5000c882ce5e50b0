"""Launched by tests/integrations/test_accelerate_fsdp.py as users launch: `torchrun --nproc-per-node 2 accelerate_fsdp_job.py
RESULTS`. Accelerate's FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)) under amp_compiler.accelerate.prepare
and under AmpTrainer (TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2})), one configuration after
another in the same two gloo ranks; each rank writes what it measured (RESULTS/rank{R}.json), the test judges it.

On CPU Accelerate 1.16 drops the FSDP plugin and wraps in DDP (distributed_type MULTI_CPU: its FSDP branch is for
GPU-like devices only). force_fsdp puts back what a GPU machine's accelerator state holds (distributed_type FSDP and
the plugin), so Accelerate's own FSDP2 preparation runs (fsdp2_prepare_model: fully_shard per auto-wrap-policy
module, then the root), on gloo. fully_shard is spied on to record each call's modules and MixedPrecisionPolicy.

The reference of every training configuration is the same conversion in one process on the global batch."""
from __future__ import annotations

import logging
import os
import sys
import tempfile

# the model zoo's torchvision_ops, before transformers imports torchvision (as tests/conftest.py does)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.torchvision_ops  # noqa: E402,F401
import torch  # noqa: E402
import torch.distributed.fsdp as fsdp  # noqa: E402
import transformers.trainer  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import amp_compiler  # noqa: E402
import amp_compiler.accelerate as amp_accelerate  # noqa: E402
from amp_compiler.huggingface import AmpTrainer  # noqa: E402
from amp_testing import ProfiledDtypes  # noqa: E402
from distributed_testing import write_rank_results  # noqa: E402

PER_RANK_BATCH = 4
STEPS = 4
LEARNING_RATE = 0.5
OVERFLOW_STEP = 1
MATMULS = ("addmm", "mm")
PER_BLOCK = ("embed", "blocks.0", "blocks.1", "head")   # what compile_per_block compiles one by one here


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x))) + x


class Net(nn.Module):
    """Two blocks Accelerate's transformer_based_wrap shards one by one (Block), then the root."""

    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Linear(6, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 3)

    def forward(self, x, labels=None):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if labels is None else {"loss": nn.functional.cross_entropy(logits.float(), labels),
                                              "logits": logits}


def force_fsdp(accelerator: Accelerator, plugin) -> None:
    """What a GPU machine's accelerator state holds under the plugin (on CPU Accelerate keeps MULTI_CPU)."""
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP   # AcceleratorState() copies it back


class ForcedFSDPAccelerator(Accelerator):
    """The Accelerator the Trainer builds (transformers.trainer.Accelerator), with force_fsdp applied."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        force_fsdp(self, kwargs["fsdp_plugin"])


class FullyShardSpy:
    """Replaces torch.distributed.fsdp.fully_shard (fsdp2_prepare_model imports it at each call): each call's
    module paths and policy."""

    def __init__(self, model: nn.Module):
        self.paths = {id(module): path or "<root>" for path, module in model.named_modules()}
        self.calls: list[dict] = []

    def __enter__(self):
        self.original = fsdp.fully_shard

        def fully_shard(module, **options):
            modules = module if isinstance(module, (list, tuple)) else [module]
            self.calls.append({"modules": [self.paths.get(id(m), type(m).__name__) for m in modules],
                               "policy": policy_dict(options.get("mp_policy"))})
            return self.original(module, **options)
        fsdp.fully_shard = fully_shard
        return self

    def __exit__(self, *exc):
        fsdp.fully_shard = self.original


def policy_dict(policy) -> dict | None:
    return None if policy is None else {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype)}


def dataset(accumulation: int) -> TensorDataset:
    count = STEPS * accumulation * PER_RANK_BATCH * 2
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(count, 6, generator=generator), torch.randint(0, 3, (count,), generator=generator))


def global_batches(data: TensorDataset, accumulation: int) -> list[tuple]:
    """Accelerate's sharded loader (and the Trainer's sequential one) gives rank r the r-th batch of every two."""
    size = 2 * accumulation * PER_RANK_BATCH
    return [data[k * size:(k + 1) * size] for k in range(STEPS)]


def fresh_net() -> Net:
    torch.manual_seed(0)
    return Net()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor   # a collective: every rank calls it


def flat(model) -> list[float]:
    return torch.cat([full(p.detach()).flatten() for p in model.parameters()]).tolist()


def one_process(level: str, dtype: torch.dtype, batches: list[tuple], per_rank: bool = False,
                skipped=()) -> list[float]:
    """The unsharded run, one process, plain SGD on the unscaled loss (fp16's scale is a power of two here).
    per_rank=False: the whole model converted, the global batch's mean loss per step (what a user compares to).
    per_rank=True: what the sharded ranks compute, in one process: the model converted per block (as FSDP2's
    per-block compilation does) and each rank's micro-batch's loss on its own, their gradients summed / averaged
    as FSDP2's reduce-scatter and the accumulation do; only the order of the fp32 sums differs."""
    model = fresh_net()
    if per_rank:
        for path in PER_BLOCK:
            amp_compiler.convert(model.get_submodule(path), level, inplace=True, dtype=dtype)
    else:
        amp_compiler.convert(model, level, inplace=True, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step, (x, y) in enumerate(batches):
        if step in skipped:
            continue
        pieces = len(x) // PER_RANK_BATCH if per_rank else 1
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            (nn.functional.cross_entropy(model(xs).float(), ys) / pieces).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def references(level: str, dtype: torch.dtype, batches: list[tuple], skipped=()) -> dict:
    return {"reference": one_process(level, dtype, batches, skipped=skipped),
            "per_rank_reference": one_process(level, dtype, batches, per_rank=True, skipped=skipped)}


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def plugin(**options) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["Block"], **options)


def fsdp_accelerator(the_plugin, accumulation: int = 1) -> Accelerator:
    AcceleratorState._reset_state(True)   # one Accelerator per configuration; the process group stays
    accelerator = Accelerator(mixed_precision="no", cpu=True, fsdp_plugin=the_plugin,
                              gradient_accumulation_steps=accumulation)
    dropped = str(accelerator.distributed_type)   # what Accelerate chose on CPU
    force_fsdp(accelerator, the_plugin)
    accelerator.dropped_to = dropped
    return accelerator


def sharded_facts(model: nn.Module, spy: FullyShardSpy) -> dict:
    record = amp_compiler.converted.compiled_record(model)
    return {"fully_shard": spy.calls, "class": type(model).__name__,
            "dtensors": all(type(p).__name__ == "DTensor" for p in model.parameters()),
            "compiled": type(record).__name__, "note": getattr(record, "note", None)}


def train_with_prepare(level: str, dtype: torch.dtype, accumulation: int = 1, overflow: bool = False) -> dict:
    """overflow: rank 1's input gets an inf at step OVERFLOW_STEP; every rank skips, each replays its own batch."""
    the_plugin = plugin()
    accelerator = fsdp_accelerator(the_plugin, accumulation)
    data = dataset(accumulation)
    model = fresh_net()
    scaler = amp_compiler.GradScaler(init_scale=2.0 ** 8) if dtype == torch.float16 else None
    with FullyShardSpy(model) as spy:
        prepared, optimizer, loader = amp_accelerate.prepare(
            accelerator, model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
            DataLoader(data, batch_size=PER_RANK_BATCH), level=level, dtype=dtype, scaler=scaler)
    recorder, skipped, scales, report, messages = ProfiledDtypes(), [], [], None, Messages()
    logging.getLogger("amp_compiler.accelerate").addHandler(messages)
    for micro, (x, y) in enumerate(loader):
        if overflow and micro == OVERFLOW_STEP and accelerator.process_index == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        with accelerator.accumulate(prepared):
            profiled = micro == len(loader) - 1   # graphs made by then: the profile holds no tracing
            if profiled:
                recorder.__enter__()
            accelerator.backward(nn.functional.cross_entropy(prepared(x).float(), y))
            if profiled:
                recorder.__exit__(None, None, None)
            optimizer.step()
            if accelerator.sync_gradients:
                skipped.append(bool(optimizer.step_was_skipped))
                scales.append(scaler.get_scale() if scaler is not None else None)
                if optimizer.step_was_skipped:   # on every rank: the replay's all-gathers are collectives
                    report = amp_accelerate.explain_overflow(
                        accelerator, prepared, lambda: nn.functional.cross_entropy(prepared(x).float(), y))
            optimizer.zero_grad()
    logging.getLogger("amp_compiler.accelerate").removeHandler(messages)
    return {**sharded_facts(model, spy), "dropped_to": accelerator.dropped_to,
            "distributed_type": str(accelerator.distributed_type), "same_object": prepared is model,
            "plugin_policy_after": policy_dict(the_plugin.mixed_precision_policy),
            "matmul_dtypes": sorted(str(d) for d in recorder.input_dtypes(*MATMULS)),
            "matmul_calls": sum(len(recorder.calls.get(op, ())) for op in MATMULS),
            "norm_dtypes": sorted(str(d) for d in recorder.input_dtypes("native_layer_norm")),
            "skipped": skipped, "scales": scales, "messages": messages.lines,
            "report_module": None if report is None else (report.forward or report.backward or {}).get("module"),
            "start": flat(fresh_net()), "params": flat(model),
            **references(level, dtype, global_batches(data, accumulation),
                         skipped=[step for step, was in enumerate(skipped) if was])}


def train_with_trainer(level: str, dtype: torch.dtype) -> dict:
    AcceleratorState._reset_state(True)
    data = dataset(1)
    examples = [{"x": data.tensors[0][i], "labels": int(data.tensors[1][i])} for i in range(len(data))]
    model = fresh_net()
    transformers.trainer.Accelerator = ForcedFSDPAccelerator
    try:
        with tempfile.TemporaryDirectory() as output_dir, FullyShardSpy(model) as spy:
            args = TrainingArguments(
                output_dir=output_dir, use_cpu=True, per_device_train_batch_size=PER_RANK_BATCH, max_steps=STEPS,
                optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=0.0,
                train_sampling_strategy="sequential", save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]})
            trainer = AmpTrainer(model=model, args=args, train_dataset=examples, amp_level=level, amp_dtype=dtype)
            trainer.train()
    finally:
        transformers.trainer.Accelerator = Accelerator
    return {**sharded_facts(model, spy), "distributed_type": str(trainer.accelerator.distributed_type),
            "fsdp_enabled": trainer.is_fsdp_enabled, "wrapped": type(trainer.model_wrapped).__name__,
            "start": flat(fresh_net()), "params": flat(model),
            **references(level, dtype, global_batches(data, 1))}


def refusal(the_plugin, level: str = "O1") -> str | None:
    accelerator = fsdp_accelerator(the_plugin)
    model = fresh_net()
    try:
        amp_accelerate.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), level=level)
    except ValueError as refused:
        return str(refused)
    return None


CONFIGURATIONS = {
    "prepare bf16 O1": lambda: train_with_prepare("O1", torch.bfloat16),
    "prepare fp16 O2, 2 micro-batches a step": lambda: train_with_prepare("O2", torch.float16, accumulation=2),
    "prepare bf16 O3": lambda: train_with_prepare("O3", torch.bfloat16),
    "prepare fp16 O1, rank 1 overflows at step 1": lambda: train_with_prepare("O1", torch.float16, overflow=True),
    "AmpTrainer bf16 O1": lambda: train_with_trainer("O1", torch.bfloat16),
    "refused: bf16 gathers at O1": lambda: refusal(plugin(mixed_precision_policy=fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
    "refused: fp16 reduction at O1": lambda: refusal(plugin(mixed_precision_policy=fsdp.MixedPrecisionPolicy(
        reduce_dtype=torch.float16))),
    "refused: FSDP1": lambda: refusal(FullyShardedDataParallelPlugin(fsdp_version=1)),
}


def main(results_dir: str) -> None:
    torch.set_num_threads(1)
    results = {name: run() for name, run in CONFIGURATIONS.items()}
    write_rank_results(results_dir, results)


if __name__ == "__main__":
    main(sys.argv[1])
