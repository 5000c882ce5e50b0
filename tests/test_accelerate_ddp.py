"""amp_compiler.accelerate.prepare under DDP, launched as users launch (torchrun --nproc-per-node 2, gloo on CPU):
accelerate_ddp_job.py runs each configuration in the same two ranks; this judges what each rank measured.
One launch, ~15 s wall on an idle 2-core machine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed_testing import run_with_torchrun

pytestmark = pytest.mark.distributed

TOLERANCE = {"bf16 O1": 0.02, "fp16 O2, 2 micro-batches a step": 0.01, "fp16 O1, rank 1 overflows at step 1": 0.01}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_with_torchrun(Path(__file__).parent / "accelerate_ddp_job.py", timeout=300)


@pytest.mark.parametrize("configuration", list(TOLERANCE))
def test_each_rank_trains_to_one_process_on_the_global_batch_with_matmuls_low(ranks, configuration):
    first, second = (rank[configuration] for rank in ranks)
    low = "torch.bfloat16" if configuration.startswith("bf16") else "torch.float16"
    for rank in (first, second):
        assert rank["wrapped"] == "DistributedDataParallel" and rank["distributed_type"].endswith("MULTI_CPU")
        assert rank["matmul_dtypes"] == [low] and rank["matmul_calls"] == 8   # 3 forward, 5 backward: all low
    assert first["params"] == second["params"], "the ranks' parameters differ"
    params, reference, start = (torch.tensor(first[key]) for key in ("params", "reference", "start"))
    moved, off = (reference - start).norm(), (params - reference).norm()
    # measured: bf16 5.5e-3 of the move, fp16 5.1e-4 and 4.6e-4 (DDP sums the gradients of 4-row matmuls)
    assert moved > 0.1 and off <= TOLERANCE[configuration] * moved, f"{off:.3g} off one process, moved {moved:.3g}"


def test_one_ranks_overflow_skips_the_step_on_every_rank_and_that_rank_says_where(ranks):
    first, second = (rank["fp16 O1, rank 1 overflows at step 1"] for rank in ranks)
    for rank in (first, second):
        assert rank["skipped"] == [False, True, False, False]
        assert rank["scales"] == [256.0, 128.0, 128.0, 128.0]
        assert rank["unchanged_by_skip"] is True
    assert second["report_module"] == "head" and "head" in second["messages"][0]
    assert first["report_module"] is None and "another rank" in first["messages"][0]
