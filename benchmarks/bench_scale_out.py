"""Scale-out on 2 gloo CPU ranks (issue 32): step time and bytes moved per step, amp-compiler O1 bf16 against each
framework's own bf16 on the same ranks: a plain loop under FSDP2 per block and DDP (against torch.autocast, how
plain-PyTorch users run it), Lightning's ModelParallelStrategy (FSDP2 per block in configure_model; AmpPrecision
against precision="bf16-mixed") and Accelerate's DDP (amp_compiler.accelerate.prepare against
Accelerator(mixed_precision="bf16")).

    python benchmarks/bench_scale_out.py [--steps 8] [--repeats 3] [--only lightning,accelerate] [--write-docs]

--write-docs writes the table into docs/scale-out.md (between its bench-scale-out markers).

Bytes: FSDP2 calls torch.distributed's all_gather_single / reduce_scatter_single / all_reduce from Python, wrapped
here in each rank's process (all-gathered: the gathered output; reduce-scattered: the full tensor handed in);
DDP all-reduces its buckets from C++: registered as its comm hook, the default allreduce_hook calls dist.all_reduce.
Rank 0's bytes over the timed steps, per step. Step time:
the median of the timed steps after 2 warm-up steps, rank 0's (a barrier ends each step); all rows run --repeats
rounds, one after another, and each row prints the median of its rounds (the machine's load shared alike). Lightning and Accelerate
run in the spawned ranks themselves: the environment says which rank each is (LOCAL_RANK, RANK, WORLD_SIZE), so
Lightning starts no processes of its own and Accelerate finds MULTI_CPU, and both take the process group that is
already there. Lightning's step is timed by a callback from on_train_batch_start to on_train_batch_end (its
optimizer step inside), on the same per-rank batch as the plain loop (use_distributed_sampler=False); Accelerate's
prepared DDP model gets the counting all-reduce hook as plain DDP does. Each model is the same 4-block MLP.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import inspect
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE, WIDTH, WARMUP = 2, 256, 2
# collective -> (column, which argument's bytes: the gathered output, the full tensor handed to a reduce-scatter)
COUNTED = {"all_gather_single": ("all-gathered", 0), "all_gather_into_tensor": ("all-gathered", 0),
           "reduce_scatter_single": ("reduce-scattered", 1), "reduce_scatter_tensor": ("reduce-scattered", 1),
           "all_reduce": ("all-reduced", 0)}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def count_collectives(counts: collections.Counter) -> None:
    def wrapped(name, original):
        column, argument = COUNTED[name]
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            tensor = list(signature.bind(*args, **kwargs).arguments.values())[argument]   # FSDP2 passes keywords
            counts[column] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return call
    for name in COUNTED:
        if hasattr(dist, name):
            setattr(dist, name, wrapped(name, getattr(dist, name)))


def counted_ddp(model: nn.Module) -> nn.Module:
    """DDP all-reduces its buckets from C++; with the default all-reduce as a comm hook (the same collective) they
    go through Python's dist.all_reduce, which count_collectives wraps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook)
    return ddp


def built(setup: str, rank: int):
    import amp_compiler
    torch.manual_seed(0)
    model = Net()
    amp = setup.endswith("amp-compiler")
    if amp:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = amp_compiler.convert(block, "O1", dtype=torch.bfloat16)
    if setup.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = counted_ddp(model)
    return model, amp


def timed(setup: str, rank: int, steps: int, counts: collections.Counter) -> tuple[float, dict]:
    model, amp = built(setup, rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(rank)
    times = []
    for step in range(WARMUP + steps):
        if step == WARMUP:
            counts.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        if amp:
            loss = nn.functional.cross_entropy(model(x).float(), y)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:]), {k: v / steps for k, v in counts.items()}


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(64, WIDTH, generator=generator), torch.randint(0, 16, (64,), generator=generator)


def timed_lightning(setup: str, rank: int, steps: int, counts: collections.Counter) -> tuple[float, dict]:
    """Lightning Trainer with ModelParallelStrategy (FSDP2): AmpPrecision O1 bf16 or precision="bf16-mixed"."""
    import amp_compiler.models.torchvision_ops  # noqa: F401 - torchvision's op schemas before Lightning imports it
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from amp_compiler.lightning import AmpPrecision

    class Sharded(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = Net()

        def configure_model(self):   # as Lightning's FSDP2 docs shard: each block, then the root
            plugin = self.trainer.precision_plugin
            policy = plugin.mp_policy if isinstance(plugin, AmpPrecision) else MixedPrecisionPolicy()
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    clock = step_clock(counts)
    x, y = batch(rank)
    data = torch.utils.data.TensorDataset(x.repeat(WARMUP + steps, 1), y.repeat(WARMUP + steps))
    amp = setup.endswith("amp-compiler")
    precision = dict(plugins=[AmpPrecision("O1", dtype=torch.bfloat16)]) if amp else dict(precision="bf16-mixed")
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, max_steps=WARMUP + steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=[clock],
                         strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1),
                         **precision)
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=64))
    return statistics.median(clock.times[WARMUP:]), {k: v / steps for k, v in clock.moved.items()}


def step_clock(counts: collections.Counter):
    """A Lightning callback timing each step (a barrier ends it, as in the plain loop) and the bytes it moved."""
    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        def __init__(self):
            self.times, self.moved = [], collections.Counter()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.before, self.start = collections.Counter(counts), time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            dist.barrier()
            self.times.append(time.perf_counter() - self.start)
            if len(self.times) > WARMUP:
                self.moved.update({k: v - self.before.get(k, 0) for k, v in counts.items()})
    return StepClock()


def timed_accelerate(setup: str, rank: int, steps: int, counts: collections.Counter) -> tuple[float, dict]:
    """Accelerate DDP (MULTI_CPU): amp_compiler.accelerate.prepare O1 bf16 or Accelerator(mixed_precision="bf16")."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import amp_compiler.accelerate as amp_accelerate
    AcceleratorState._reset_state(True)   # one Accelerator per row; the process group stays
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if setup.endswith("amp-compiler"):
        accelerator = Accelerator(mixed_precision="no", cpu=True)
        model, optimizer = amp_accelerate.prepare(accelerator, model, optimizer, dtype=torch.bfloat16)
    else:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)   # its prepare wraps forward in autocast
        model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise RuntimeError(f"Accelerate prepared a {type(model).__name__}, not DDP ({accelerator.distributed_type})")
    model.register_comm_hook(None, allreduce_hook)   # counted, as counted_ddp does
    x, y = batch(rank)
    times = []
    for step in range(WARMUP + steps):
        if step == WARMUP:
            counts.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x).float(), y))
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:]), {k: v / steps for k, v in counts.items()}


SETUPS = {"fsdp2 + amp-compiler": timed, "fsdp2 + autocast": timed, "ddp + amp-compiler": timed,
          "ddp + autocast": timed, "lightning fsdp2 + amp-compiler": timed_lightning,
          "lightning fsdp2 + bf16-mixed": timed_lightning, "accelerate ddp + amp-compiler": timed_accelerate,
          "accelerate ddp + bf16": timed_accelerate}


def worker(rank: int, port: int, steps: int, repeats: int, only: tuple[str, ...], write_docs: bool,
           command: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # who this process is, as torchrun would say: Lightning then launches nothing, Accelerate finds MULTI_CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=120))
    counts: collections.Counter = collections.Counter()
    count_collectives(counts)
    chosen = {setup: run for setup, run in SETUPS.items() if not only or setup.startswith(only)}
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    moved, failed = {}, {}
    for _ in range(repeats):   # every row once per round: a load that comes and goes hits all rows alike
        for setup, run in chosen.items():
            if setup in failed:
                continue
            try:
                step_seconds, moved[setup] = run(setup, rank, steps, counts)
                seconds[setup].append(step_seconds)
            except Exception as error:   # noqa: BLE001   a row that fails says why and the table goes on
                failed[setup] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    rows = [(setup, failed[setup], "", "", "") if setup in failed else
            (setup, f"{statistics.median(seconds[setup]) * 1e3:8.1f}",
             *(f"{moved[setup].get(k, 0) / 2**20:8.2f}" for k in ("all-gathered", "reduce-scattered", "all-reduced")))
            for setup in chosen]
    if rank == 0:
        print("rounds, ms: " + "; ".join(f"{setup} " + " ".join(f"{t * 1e3:.1f}" for t in times)
                                         for setup, times in seconds.items()), file=sys.stderr)
        printed = table(rows, steps, repeats)
        print(f"{command}  ({datetime.datetime.now():%Y-%m-%d %H:%M})")
        if write_docs:
            import doc_tables
            doc_tables.write_table("scale-out.md", "bench-scale-out", printed, command)
    dist.barrier()
    os._exit(0)


def table(rows: list[tuple], steps: int, repeats: int) -> str:
    """Print the table; return what was printed."""
    lines = [f"{'setup':32} {'step ms':>8} {'MiB gathered':>12} {'MiB red-scat':>12} {'MiB all-red':>12}"]
    lines += [f"{row[0]:32} {row[1]:>8} {row[2]:>12} {row[3]:>12} {row[4]:>12}" for row in rows]
    lines.append(f"({WORLD_SIZE} gloo CPU ranks, 1 thread each; rank 0's median of {steps} steps after {WARMUP} "
                 f"warm-up, median of {repeats} rounds of all rows; MiB per step)")
    print("\n".join(lines))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all rows; each row's median is printed")
    parser.add_argument("--only", default="", help="comma-separated row prefixes: fsdp2, ddp, lightning, accelerate")
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/scale-out.md (bench-scale-out)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # doc_tables, in the spawned ranks too
    import doc_tables
    only = tuple(f"{name} " for name in args.only.split(",") if name)
    steps = args.steps
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, steps, args.repeats, only, args.write_docs, doc_tables.command_line()), nprocs=WORLD_SIZE,
             join=True)


if __name__ == "__main__":
    main()
