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


# -- launched as users launch: torchrun ---------------------------------------------------------------------

def run_with_torchrun(script, *args: str, timeout: float = 240.0) -> list[dict]:
    """Launch `script` as users do, `torchrun --nproc-per-node WORLD_SIZE script RESULTS *args` (python -m
    torch.distributed.run, gloo on CPU, one intra-op thread per rank), and return what each rank wrote with
    write_rank_results(RESULTS, ...), by rank. A rank that fails, or writes nothing, fails the caller with the
    launch's output."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    tests = str(Path(__file__).parent)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD_SIZE}",
                   "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(script), results, *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        written = [Path(results) / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
        if done.returncode != 0 or not all(path.exists() for path in written):
            raise AssertionError(f"torchrun {Path(script).name} exited {done.returncode}:\n"
                                 f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
        return [json.loads(path.read_text()) for path in written]


def write_rank_results(results_dir: str, results: dict) -> None:
    """In a launched script: this rank's results (JSON), for run_with_torchrun to return."""
    import json
    from pathlib import Path
    path = Path(results_dir) / f"rank{dist.get_rank()}.json"
    path.with_suffix(".tmp").write_text(json.dumps(results))
    path.with_suffix(".tmp").rename(path)   # whole or absent: a rank that died mid-write fails the caller
