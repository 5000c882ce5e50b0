"""Scale-out on 2 gloo CPU ranks (issue 32): step time and bytes moved per step, amp-compiler O1 bf16 against
torch.autocast bf16 (how plain-PyTorch users run it) on the same ranks, under FSDP2 per block and DDP.

    python benchmarks/bench_scale_out.py [--steps 8]

Bytes: FSDP2 calls torch.distributed's all_gather_single / reduce_scatter_single / all_reduce from Python, wrapped
here in each rank's process (all-gathered: the gathered output; reduce-scattered: the full tensor handed in);
DDP all-reduces its buckets from C++: registered as its comm hook, the default allreduce_hook calls dist.all_reduce.
Rank 0's bytes over the timed steps, per step. Step time:
the median of the timed steps after 2 warm-up steps, rank 0's. Lightning and Accelerate rows are not in this
version (not written in time: issue 32's remaining rows).
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
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, WIDTH, generator=generator), torch.randint(0, 16, (64,), generator=generator)
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


SETUPS = ("fsdp2 + amp-compiler", "fsdp2 + autocast", "ddp + amp-compiler", "ddp + autocast")


def worker(rank: int, port: int, steps: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=120))
    counts: collections.Counter = collections.Counter()
    count_collectives(counts)
    rows = []
    for setup in SETUPS:
        try:
            seconds, moved = timed(setup, rank, steps, counts)
            rows.append((setup, f"{seconds * 1e3:8.1f}", *(f"{moved.get(k, 0) / 2**20:8.2f}"
                                                             for k in ("all-gathered", "reduce-scattered", "all-reduced"))))
        except Exception as error:   # noqa: BLE001   a row that fails says why and the table goes on
            rows.append((setup, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}", "", "", ""))
    if rank == 0:
        print(f"{'setup':24} {'step ms':>8} {'MiB gathered':>12} {'MiB red-scat':>12} {'MiB all-red':>12}")
        for row in rows:
            print(f"{row[0]:24} {row[1]:>8} {row[2]:>12} {row[3]:>12} {row[4]:>12}")
        print(f"\n{' '.join(['python', *sys.argv])}  ({datetime.datetime.now():%Y-%m-%d %H:%M}, {WORLD_SIZE} gloo "
              f"CPU ranks, 1 thread each, median of {steps} steps after {WARMUP})")
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    steps = parser.parse_args().steps
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, steps), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
