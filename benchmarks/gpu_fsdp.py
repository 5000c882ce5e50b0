"""One command for a CUDA machine: amp-compiler under FSDP through each launcher, printed as one table.

    python benchmarks/gpu_fsdp.py               # CUDA, world size = the GPUs seen (1 lent: FSDP2 on 1 rank, nccl)
    python benchmarks/gpu_fsdp.py --nproc 4     # 4 ranks (torchrun --nproc-per-node 4)
    python benchmarks/gpu_fsdp.py --dry-run     # CPU, 2 gloo ranks, tiny sizes: keeps this script from rotting

The script launches itself under torchrun (`python -m torch.distributed.run --nproc-per-node N`), as users launch
these frameworks. Each setup trains the same model (8 pre-norm MLP blocks, hidden 1024; dry run: 2 blocks, hidden
32) for the same STEPS SGD steps on the same per-rank batches, three ways: amp-compiler O1 bf16, amp-compiler O2
fp16 (its GradScaler), and the framework's own bf16:

  plain FSDP2           fully_shard per block, then the root; ours with the level's MixedPrecisionPolicy
                        (amp_compiler.train.fsdp_policy); the framework's: MixedPrecisionPolicy(bf16, fp32 reduce)
  accelerate fsdp2      Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, transformer_based_wrap
                        on Block)); ours: amp_compiler.accelerate.prepare with mixed_precision="no"; the framework's:
                        mixed_precision="bf16"
  hf trainer fsdp2      TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2, transformer_layer_cls_to_wrap:
                        Block}); ours: AmpTrainer(amp_level=, amp_dtype=); the framework's: Trainer(bf16=True)
  lightning fsdp2       Trainer(strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)), fully_shard in configure_model with
                        plugin.mp_policy; ours: AmpPrecision; the framework's: precision="bf16-mixed"
  lightning fsdp1       Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block})); ours: AmpFSDPPrecision; the
                        framework's: precision="bf16-mixed". Lightning runs FSDP1 on GPUs only

Columns: step ms (median of the steps after the first WARMUP, rank 0, CUDA synchronized), peak MiB (rank 0's
torch.cuda.max_memory_allocated over the run; "-" on CPU), off fp32 (|params - fp32| / |fp32 - start|: the gathered
parameters after STEPS steps against the unsharded fp32 run in one process on the global batch, i.e. both ranks'
batches at each step), matmuls low (mm/addmm/bmm calls of rank 0's last step whose inputs are bf16/fp16, from
torch.profiler). On CPU Accelerate drops the FSDP plugin for DDP: the dry run sets the accelerator state to what a
GPU machine's holds (as tests/integrations/test_accelerate_fsdp.py does), and says so in the setup's name. A time budget
(--budget-s) skips what is left, saying so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

VARIANTS = ("ours O1 bf16", "ours O2 fp16", "framework bf16")
SETUPS = ("plain fsdp2", "accelerate fsdp2", "hf trainer fsdp2", "lightning fsdp2", "lightning fsdp1")
NEEDS_CUDA = {"lightning fsdp1"}   # Lightning's FSDPStrategy refuses a CPU accelerator
STEPS, WARMUP = 6, 2
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
LOW_NAMES = ("c10::BFloat16", "c10::Half")   # torch.profiler's names of the input dtypes
FLOAT_NAMES = LOW_NAMES + ("float", "double")
LEARNING_RATE = 0.1


@dataclass
class Sizes:
    blocks: int
    hidden: int
    features: int
    classes: int
    batch: int
    seq: int


GPU_SIZES = Sizes(blocks=8, hidden=1024, features=256, classes=512, batch=8, seq=256)
DRY_SIZES = Sizes(blocks=2, hidden=32, features=16, classes=8, batch=2, seq=4)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Pre-norm MLP blocks between an input projection and a head; forward(x, labels) returns the Trainer's dict."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.embed = nn.Linear(sizes.features, sizes.hidden)
        self.blocks = nn.ModuleList([Block(sizes.hidden) for _ in range(sizes.blocks)])
        self.head = nn.Linear(sizes.hidden, sizes.classes)

    def forward(self, x, labels=None):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if labels is None else {"loss": loss_of(logits, labels), "logits": logits}


def loss_of(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())


@dataclass
class Run:
    sizes: Sizes
    device: torch.device
    rank: int
    world: int
    dry_run: bool

    def fresh_net(self) -> Net:
        torch.manual_seed(0)
        return Net(self.sizes)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        s = self.sizes
        return (torch.randn(s.batch, s.seq, s.features, generator=generator),
                torch.randint(0, s.classes, (s.batch, s.seq), generator=generator))

    def my_batches(self) -> list[tuple]:
        return [self.batch(self.rank, step) for step in range(STEPS)]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# -- measuring ------------------------------------------------------------------------------------------------
class Meter:
    """Step times, rank 0's peak memory, the last step's matmul dtypes."""

    def __init__(self, run: Run):
        self.run, self.times, self.started, self.profile = run, [], None, None
        self.low = self.matmuls = 0
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(run.device)

    def begin(self, step: int) -> None:
        self.run.sync()
        if step == STEPS - 1:   # graphs made by then: the profile holds no tracing
            self.profile = torch.profiler.profile(record_shapes=True)
            self.profile.__enter__()
        self.started = time.perf_counter()

    def end(self, step: int) -> None:
        self.run.sync()
        self.times.append(time.perf_counter() - self.started)
        if self.profile is not None:
            self.profile.__exit__(None, None, None)
            calls = [[d for d in e.input_dtypes if d in FLOAT_NAMES] for e in self.profile.events() if e.name in MATMULS]
            self.matmuls = len(calls)
            self.low = sum(bool(dtypes) and all(d in LOW_NAMES for d in dtypes) for dtypes in calls)
            self.profile = None

    def result(self, params: list[torch.Tensor]) -> dict:
        timed = self.times[WARMUP:] or self.times
        peak = torch.cuda.max_memory_allocated(self.run.device) / 2 ** 20 if self.run.device.type == "cuda" else None
        return {"step_ms": statistics.median(timed) * 1e3, "peak_mib": peak, "low": self.low,
                "matmuls": self.matmuls, "params": flat(params)}


def flat(params) -> torch.Tensor:
    """The full parameters (DTensor shards gathered: a collective, every rank calls it), on the CPU."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten().cpu()
                      for p in params])


def fp32_reference(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded fp32 run in one process on the global batch (every rank's batch of each step)."""
    model = run.fresh_net().to(run.device)
    start = flat(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        xs, ys = zip(*(run.batch(rank, step) for rank in range(run.world)))
        loss_of(model(torch.cat(xs).to(run.device)), torch.cat(ys).to(run.device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return start, flat(model.parameters())


def variant_options(variant: str) -> tuple[str, torch.dtype]:
    return {"ours O1 bf16": ("O1", torch.bfloat16), "ours O2 fp16": ("O2", torch.float16)}[variant]


# -- plain FSDP2 ------------------------------------------------------------------------------------------------
def plain_fsdp2(run: Run, variant: str) -> dict:
    import amp_compiler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from amp_compiler.train.fsdp_policy import level_mp_policy
    model, scaler = run.fresh_net().to(run.device), None
    if variant == "framework bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        level, dtype = variant_options(variant)
        amp_compiler.convert(model, level, inplace=True, dtype=dtype)
        policy = level_mp_policy(level, dtype)
        scaler = amp_compiler.GradScaler(run.device.type) if dtype == torch.float16 else None
    mesh = init_device_mesh(run.device.type, (run.world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    meter = Meter(run)
    for step, (x, y) in enumerate(run.my_batches()):
        meter.begin(step)
        loss = loss_of(model(x.to(run.device)), y.to(run.device))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        meter.end(step)
    return meter.result(model.parameters())


# -- Accelerate and the HF Trainer --------------------------------------------------------------------------------
def accelerate_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["Block"])


def force_fsdp_on_cpu(accelerator, plugin) -> None:
    """On CPU Accelerate drops the plugin for DDP (MULTI_CPU): the state a GPU machine's accelerator holds."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    if accelerator.device.type == "cpu":
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if accelerator.mixed_precision != "no":   # what the state's FSDP branch does with the plugin
            plugin.set_mixed_precision(accelerator.mixed_precision)


def accelerate_fsdp2(run: Run, variant: str) -> dict:
    import amp_compiler
    import amp_compiler.accelerate as amp_accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)   # one Accelerator per row; the process group stays
    plugin = accelerate_plugin()
    mixed = "bf16" if variant == "framework bf16" else "no"
    accelerator = Accelerator(mixed_precision=mixed, fsdp_plugin=plugin, cpu=run.device.type == "cpu")
    force_fsdp_on_cpu(accelerator, plugin)
    model = run.fresh_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if variant == "framework bf16":
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        level, dtype = variant_options(variant)
        scaler = amp_compiler.GradScaler(run.device.type) if dtype == torch.float16 else None
        model, optimizer = amp_accelerate.prepare(accelerator, model, optimizer, level=level, dtype=dtype,
                                                  scaler=scaler)
    meter = Meter(run)
    for step, (x, y) in enumerate(run.my_batches()):
        meter.begin(step)
        accelerator.backward(loss_of(model(x.to(accelerator.device)), y.to(accelerator.device)))
        optimizer.step()
        optimizer.zero_grad()
        meter.end(step)
    return meter.result(model.parameters())


def trainer_examples(run: Run) -> list[dict]:
    """Rank r reads the r-th batch of every world-size batches (Accelerate's sharded sequential loader)."""
    examples = []
    for step in range(STEPS):
        for rank in range(run.world):
            x, y = run.batch(rank, step)
            examples += [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    return examples


def hf_trainer_fsdp2(run: Run, variant: str) -> dict:
    import transformers.trainer
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from amp_compiler.huggingface import AmpTrainer
    AcceleratorState._reset_state(True)
    meter = Meter(run)

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            meter.end(state.global_step - 1)

    class CpuForcedAccelerator(Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            force_fsdp_on_cpu(self, kwargs.get("fsdp_plugin"))

    model = run.fresh_net()
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, use_cpu=run.device.type == "cpu", per_device_train_batch_size=run.sizes.batch,
            max_steps=STEPS, optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
            max_grad_norm=0.0, train_sampling_strategy="sequential", save_strategy="no", report_to=[],
            disable_tqdm=True, logging_steps=STEPS, seed=0, bf16=variant == "framework bf16",
            fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Block"]})
        options = dict(model=model, args=args, train_dataset=trainer_examples(run), callbacks=[Timing()])
        transformers.trainer.Accelerator = CpuForcedAccelerator
        try:
            if variant == "framework bf16":
                trainer = Trainer(**options)
            else:
                level, dtype = variant_options(variant)
                trainer = AmpTrainer(**options, amp_level=level, amp_dtype=dtype)
            trainer.train()
        finally:
            transformers.trainer.Accelerator = Accelerator
    return meter.result(model.parameters())


# -- Lightning ------------------------------------------------------------------------------------------------
def lightning_fit(run: Run, variant: str, fsdp1: bool) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from amp_compiler.lightning import AmpFSDPPrecision, AmpPrecision
    meter = Meter(run)

    class Sharded(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = run.fresh_net()

        def configure_model(self):
            if fsdp1:
                return   # FSDPStrategy wraps per auto_wrap_policy itself
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            plugin = self.trainer.precision_plugin
            policy = plugin.mp_policy if isinstance(plugin, AmpPrecision) else MixedPrecisionPolicy()
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_of(self.model(x), y)

        def on_train_batch_start(self, batch, batch_idx):
            meter.begin(self.global_step)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            meter.end(self.global_step - 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)

    xs, ys = zip(*run.my_batches())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)),
                                         batch_size=run.sizes.batch)
    if variant == "framework bf16":
        precision = {"precision": "bf16-mixed"}
    else:
        level, dtype = variant_options(variant)
        precision = {"plugins": [(AmpFSDPPrecision if fsdp1 else AmpPrecision)(level, dtype=dtype)]}
    strategy = FSDPStrategy(auto_wrap_policy={Block}) if fsdp1 else \
        ModelParallelStrategy(data_parallel_size=run.world, tensor_parallel_size=1)   # "auto" is tensor parallel
    module = Sharded()
    trainer = pl.Trainer(accelerator=run.device.type, devices=run.world, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, **precision)
    trainer.fit(module, loader)
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        with FullyShardedDataParallel.summon_full_params(module):   # every FSDP unit below it, gathered
            return meter.result(list(module.model.parameters()))
    return meter.result(module.model.parameters())


SETUP_RUNS = {
    "plain fsdp2": plain_fsdp2,
    "accelerate fsdp2": accelerate_fsdp2,
    "hf trainer fsdp2": hf_trainer_fsdp2,
    "lightning fsdp2": lambda run, variant: lightning_fit(run, variant, fsdp1=False),
    "lightning fsdp1": lambda run, variant: lightning_fit(run, variant, fsdp1=True),
}


# -- a rank (under torchrun) ------------------------------------------------------------------------------------
def worker(args) -> None:
    from models.torchvision_ops import import_torchvision
    import_torchvision()   # transformers and Lightning import torchvision, whose C ops a CPU torch build lacks
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.dry_run:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    run = Run(DRY_SIZES if args.dry_run else GPU_SIZES, device, rank, world, args.dry_run)
    start, reference = fp32_reference(run)
    moved = (reference - start).norm()
    started, rows = time.perf_counter(), []
    for setup in args.setups:
        for variant in VARIANTS:
            name = setup + (" (forced on CPU)" if args.dry_run and setup in ("accelerate fsdp2", "hf trainer fsdp2")
                            else "")
            if args.dry_run and setup in NEEDS_CUDA:
                rows.append([name, variant, "needs CUDA"])
            elif time.perf_counter() - started > args.budget_s:
                rows.append([name, variant, f"skipped: past the {args.budget_s:g} s budget"])
            else:
                rows.append([name, variant, *measured_row(run, setup, variant, reference, moved)])
    if rank == 0:
        with open(os.path.join(args.worker, "rows.json"), "w") as file:
            json.dump(rows, file)
    dist.barrier()
    dist.destroy_process_group()


def measured_row(run: Run, setup: str, variant: str, reference: torch.Tensor, moved: torch.Tensor) -> list:
    try:
        result = SETUP_RUNS[setup](run, variant)
    except Exception as error:   # one failing setup leaves the others' rows (one rank failing alone may hang)
        traceback.print_exc()
        return [f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"]
    off = (result["params"] - reference).norm() / moved
    peak = "-" if result["peak_mib"] is None else f"{result['peak_mib']:.0f}"
    return [f"{result['step_ms']:.1f}", peak, f"{off:.2e}", f"{result['low']}/{result['matmuls']}"]


# -- the launcher -------------------------------------------------------------------------------------------------
HEADER = ["setup", "variant", "step ms", "peak MiB", "off fp32", "matmuls low"]


def print_table(rows: list[list], title: str) -> None:
    print(title)
    table = [HEADER, *rows]
    widths = [max(len(str(row[i])) for row in table if len(row) > i) for i in range(len(HEADER))]
    for row in table:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def launch(args) -> list[list]:
    nproc = args.nproc or (2 if args.dry_run else torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", os.path.abspath(__file__),
                   "--worker", results, "--budget-s", str(args.budget_s), "--setups", ",".join(args.setups)] + (["--dry-run"] if args.dry_run else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.dry_run else dict(os.environ)
        if args.dry_run:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        done = subprocess.run(command, env=env)
        path = os.path.join(results, "rows.json")
        if done.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"torchrun exited {done.returncode} without a table")
        with open(path) as file:
            rows = json.load(file)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    where = "CPU, gloo (dry run: tiny sizes)" if args.dry_run else f"{torch.cuda.get_device_name()}, nccl"
    print_table(rows, f"amp-compiler under FSDP on {nproc} rank(s), {where}; torch {torch.__version__}; "
                      f"{sizes.blocks} blocks, hidden {sizes.hidden}, {sizes.batch}x{sizes.seq} tokens a rank, "
                      f"{STEPS} SGD steps (first {WARMUP} untimed); off fp32 = |params - unsharded fp32 run| / "
                      "|its move|")
    return rows


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> list[list] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 gloo ranks, tiny sizes")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the GPUs seen; 2 with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the setups left after this many seconds")
    parser.add_argument("--setups", type=lambda text: text.split(","), default=list(SETUPS),
                        help=f"comma-separated, of: {', '.join(SETUPS)}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # a rank, started by the launcher
    args = parser.parse_args(argv)
    unknown = [setup for setup in args.setups if setup not in SETUPS]
    if unknown:
        parser.error(f"--setups: {', '.join(unknown)} unknown; choose from {', '.join(SETUPS)}")
    if args.worker is not None:
        worker(args)
        return None
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to check the script on CPU")
    return launch(args)


if __name__ == "__main__":
    main()
