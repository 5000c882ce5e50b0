"""amp_compiler.huggingface.AmpTrainer under the Trainer's DDP, launched as users launch (torchrun --nproc-per-node 2,
gloo on CPU): hf_trainer_ddp_job.py runs each configuration in the same two ranks; this judges what each rank
measured. One launch: 12 s wall on a quiet 2-core machine (10 s before the clipping and AmpCallback configurations)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed_testing import run_with_torchrun

pytestmark = pytest.mark.distributed

OVERFLOW = "fp16 O1, rank 1 overflows at step 1"
KWARGS = "bf16 O1, forward takes **kwargs, 2 micro-batches a step"
KWARGS_OPTED_OUT = "bf16 O1, forward takes **kwargs, accepts_loss_kwargs = False, 2 micro-batches a step"
CLIPPED = "fp16 O1, clipped at max_grad_norm"
CALLBACK = "bf16 O1, AmpCallback on the plain Trainer"
MAX_GRAD_NORM = 0.4   # hf_trainer_ddp_job.MAX_GRAD_NORM
# measured: bf16 5.5e-3 of the move (AmpCallback alike), fp16 O2 5.1e-4, fp16 O1 with the skip 4.6e-4, clipped
# 3.8e-4 (DDP sums 4-row matmuls' gradients)
TOLERANCE = {"bf16 O1": 0.02, "fp16 O2, 2 micro-batches a step": 0.01, OVERFLOW: 0.01, KWARGS_OPTED_OUT: 0.02,
             CLIPPED: 0.01, CALLBACK: 0.02}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_with_torchrun(Path(__file__).parents[1] / "hf_trainer_ddp_job.py", timeout=300)


def off_one_process(rank: dict, after: str = "params", reference: str = "reference") -> tuple[float, float]:
    """How far one process on the global batch moved, and how far this rank ended from it."""
    params, reference, start = (torch.tensor(rank[key]) for key in (after, reference, "start"))
    return float((reference - start).norm()), float((params - reference).norm())


@pytest.mark.parametrize("configuration", list(TOLERANCE))
def test_each_rank_trains_to_one_process_on_the_global_batch_with_matmuls_low(ranks, configuration):
    first, second = (rank[configuration] for rank in ranks)
    low = "bfloat16" if configuration.startswith("bf16") else "float16"
    for rank in (first, second):
        assert rank["trainer"] == ("Trainer" if configuration == CALLBACK else "AmpTrainer")
        assert rank["wrapped"] == "DistributedDataParallel" and rank["distributed_type"].endswith("MULTI_CPU")
        assert rank["accepts_loss_kwargs"] is False   # the loss is the batch mean, divided for accumulation
        assert rank["explained_matmuls"] == [low] and rank["explained_matmul_rows"] == 3   # embed, hidden, head
        assert rank["matmul_dtypes"] == [f"torch.{low}"] and rank["matmul_calls_per_micro_batch"] == 8  # 3 fwd, 5 bwd
    assert first["params"] == second["params"], "the ranks' parameters differ"
    moved, off = off_one_process(first)
    assert moved > 0.1 and off <= TOLERANCE[configuration] * moved, f"{off:.3g} off one process, moved {moved:.3g}"


def test_one_ranks_overflow_skips_the_step_on_every_rank_and_that_rank_says_where(ranks):
    first, second = (rank[OVERFLOW] for rank in ranks)
    for rank in (first, second):
        assert rank["skipped"] == [False, True, False, False]
        assert rank["scales"] == [256.0, 128.0, 128.0, 128.0]
        assert rank["unchanged_by_skip"] is True
    assert second["report_module"] == "head" and "head" in second["messages"][0]
    assert first["report_module"] is None and "another rank" in first["messages"][0]


def test_fp16_clipping_under_ddp_measures_the_unscaled_all_reduced_gradients(ranks):
    """The norms the Trainer logged are one process's on the global batch (a skipped unscale would log them
    times the loss scale, 256 here), each above max_grad_norm, so every step was clipped; the parameters meet
    one process clipped alike (the tolerance test above)."""
    for rank in ranks:
        logged, reference = torch.tensor(rank[CLIPPED]["grad_norms"]), torch.tensor(rank[CLIPPED]["reference_grad_norms"])
        assert len(logged) == len(reference) == 4 and bool((reference > MAX_GRAD_NORM).all()), (logged, reference)
        assert torch.allclose(logged, reference, rtol=0.01), f"logged {logged.tolist()}, one process {reference.tolist()}"


def test_amp_trainer_warns_of_the_loss_kwargs_trap_with_its_factor_under_ddp(ranks):
    for rank in ranks:
        warned = [line for line in rank[KWARGS]["messages"] if "num_items_in_batch" in line]
        assert len(warned) == 1 and "NetTakingKwargs" in warned[0] and "4x" in warned[0], rank[KWARGS]["messages"]
        assert not [line for line in rank[KWARGS_OPTED_OUT]["messages"] if "num_items_in_batch" in line]
        assert not [line for line in rank["bf16 O1"]["messages"] if "num_items_in_batch" in line]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="transformers: a forward taking **kwargs gets model_accepts_loss_kwargs=True; "
                   "with average_tokens_across_devices (default) the loss is multiplied by the world size and not "
                   "divided for accumulation; a model that ignores num_items_in_batch steps 4x (2 ranks x 2 "
                   "micro-batches, measured 4.00x, same direction). AmpTrainer does what the plain Trainer does; "
                   "the remedy, accepts_loss_kwargs = False on the model, is checked above")
def test_a_forward_taking_kwargs_that_ignores_num_items_in_batch_trains_to_one_process(ranks):
    first, second = (rank[KWARGS] for rank in ranks)
    if not (first["accepts_loss_kwargs"] is True and first["params"] == second["params"]):   # not the known issue
        pytest.fail(f"accepts_loss_kwargs {first['accepts_loss_kwargs']}, or the ranks' parameters differ")
    moved, off = off_one_process(first, "after_first_step", "reference_after_first_step")
    assert moved > 0.1 and off <= 0.02 * moved, f"{off:.3g} off one process's first step, moved {moved:.3g}"
