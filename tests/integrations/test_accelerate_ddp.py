"""amp_compiler.accelerate.prepare under DDP, launched as users launch (torchrun --nproc-per-node 2, gloo on CPU):
accelerate_ddp_job.py runs each configuration in the same two ranks; this judges what each rank measured.
One launch: 9 s wall on a quiet 2-core machine with the clipped configuration (6.7 s before it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed_testing import run_with_torchrun

pytestmark = pytest.mark.distributed

CLIPPED = "fp16 O1, clip_grad_norm_"
MAX_GRAD_NORM = 0.4   # accelerate_ddp_job.MAX_GRAD_NORM
TOLERANCE = {"bf16 O1": 0.02, "fp16 O2, 2 micro-batches a step": 0.01, "fp16 O1, rank 1 overflows at step 1": 0.01,
             CLIPPED: 0.01}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_with_torchrun(Path(__file__).parents[1] / "accelerate_ddp_job.py", timeout=300)


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
    # measured: bf16 5.5e-3 of the move, fp16 5.1e-4, 4.6e-4, clipped 3.8e-4 (DDP sums the gradients of 4-row matmuls)
    assert moved > 0.1 and off <= TOLERANCE[configuration] * moved, f"{off:.3g} off one process, moved {moved:.3g}"


def test_one_ranks_overflow_skips_the_step_on_every_rank_and_that_rank_says_where(ranks):
    first, second = (rank["fp16 O1, rank 1 overflows at step 1"] for rank in ranks)
    for rank in (first, second):
        assert rank["skipped"] == [False, True, False, False]
        assert rank["scales"] == [256.0, 128.0, 128.0, 128.0]
        assert rank["unchanged_by_skip"] is True
    assert second["report_module"] == "head" and "head" in second["messages"][0]
    assert first["report_module"] is None and "another rank" in first["messages"][0]


def test_fp16_clip_grad_norm_under_ddp_measures_the_unscaled_all_reduced_gradients(ranks):
    """accelerator.clip_grad_norm_ returned one process's norms on the global batch (a skipped unscale would return
    them times the loss scale, 256 here), each above the clipping norm, so every step was clipped; the parameters
    meet one process clipped alike (the tolerance test above)."""
    for rank in ranks:
        returned, reference = (torch.tensor(rank[CLIPPED][key]) for key in ("grad_norms", "reference_grad_norms"))
        assert len(returned) == len(reference) == 4 and bool((reference > MAX_GRAD_NORM).all()), (returned, reference)
        assert torch.allclose(returned, reference, rtol=0.01), f"returned {returned.tolist()}, one process {reference.tolist()}"
