"""Two CPU processes on loopback with gloo: what the DDP and FSDP2 tests share."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def run_on_two_ranks(check) -> None:
    """Run `check(rank)` in WORLD_SIZE spawned processes joined in one gloo group; a failure on any
    rank fails the caller. `check` must be a module-level function (spawn pickles it)."""
    mp.spawn(_worker, args=(check, _free_port()), nprocs=WORLD_SIZE, join=True)


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    copies = [torch.empty_like(tensor) for _ in range(WORLD_SIZE)]
    dist.all_gather(copies, tensor.detach().contiguous())
    return copies


def _worker(rank: int, check, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    check(rank)
    dist.barrier()
    # Tearing gloo and its TCP store down at exit aborts now and then (std::terminate, ~1 run in 50 on
    # this machine); once both ranks passed the barrier there is nothing left to clean up.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
