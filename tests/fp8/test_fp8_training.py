"""The zoo's GPT and BERT trained 200 steps at fp8 end near bf16 O1 (issue 23's training check, on the CPU).

Both runs of a model start from the same weights (build(..., seed=SEED)), see the same batches (make_batch(step))
and dropout stream (torch.manual_seed(SEED)), and step Adam at lr 1e-3: at 1e-2 BERT's loss, near 0 by step 100,
spikes now and then in both precisions alike (the mean of the last 10 steps ranged 0.0001-0.094 over seeds 0-7,
bf16 and fp8 alike), which hides any fp8 effect; at 1e-3 both models descend smoothly. fp8_min_dim=16 so the
zoo's small matmuls (32-64 wide) qualify: GPT runs 13 of its 17 low matmuls in fp8, BERT 12 of 17 (attention's
batched q @ k^T and probs @ v stay bf16, and BERT's 2-class head: N=2 is not a multiple of 16).

The margin, from measurement (mean of the last 10 of 200 steps, Adam lr 1e-3, 1 thread; 2 threads alike):
    gpt   seeds 0-2  bf16 0.7989 / 0.7601 / 0.8159
                     fp8 current +0.0038 / +0.0044 / +0.0031, delayed +0.0038 / +0.0048 / +0.0034,
                     rowwise +0.0031 / +0.0036 / +0.0019: fp8 0.2-0.6% above bf16, every seed and recipe
    bert  seeds 0-5  bf16 0.0015-0.0041 (from 0.64-0.71); fp8 within 0.0005 of it either way, every recipe
                     (current -9.7..+11.2%, delayed -20.6..+4.2%, rowwise -9.4..+6.7% of bf16's own, near 0);
                     current, seeds 6-8: within 0.0007
So the test asks |fp8 - bf16| <= MARGIN[model]: gpt 0.012 (1.5% of bf16's 0.80; 2.5x the largest gap measured),
bert 0.0015 (0.2% of the initial loss; 2-3x the largest gap). A margin relative to bf16's final loss would not
do for BERT, whose loss ends near 0, where 1e-4 is noise. What it catches, measured: e4m3 operands rounded
to one mantissa bit fewer (e5m2's) end gpt 0.0136 above bf16 (fails); values past 1/4 of e4m3's range clamped
do not train (fails); an fp8 that did not run fails on the counts and on no loss differing from bf16's.
"""
import functools

import pytest
import torch

import amp_compiler
from models import build

STEPS = 200
SEED = 0
LEARNING_RATE = 1e-3
MARGIN = {"gpt": 0.012, "bert": 0.0015}   # |fp8 - bf16| final loss at most (module docstring: measured gaps)
TRAINED = {"gpt": 0.3, "bert": 0.05}   # final / initial loss at most (measured: gpt 0.21-0.22, bert 0.002-0.013)
FP8_MATMULS = {"gpt": 13, "bert": 12}   # at least: fewer means fp8 lost matmuls it ran
RECIPES = {"current": {}, "delayed": {"fp8_history": 16}, "rowwise": {}}   # fp8_scaling -> its own options


@functools.lru_cache(maxsize=None)
def train(name: str, level: str, options: tuple) -> tuple[tuple[float, ...], dict]:
    """Losses of STEPS Adam steps of the zoo model `name` converted at `level`, and lower_fp8_matmuls' counts."""
    task = build(name, size="small", seed=SEED)
    torch.manual_seed(SEED)
    gm = amp_compiler.convert(task.model, level, example_inputs=task.example_inputs, **dict(options))
    threads = torch.get_num_threads()
    # One thread: 32-wide matmuls gain nothing from two, and two threads on a loaded machine wait on each other
    # (measured: 70-140 s per test instead of 3-10 s at a load of 6 on 2 cores)
    torch.set_num_threads(1)
    try:
        losses = task.train_losses(gm, STEPS, LEARNING_RATE)
    finally:
        torch.set_num_threads(threads)
    return tuple(losses), gm.meta["amp"]["pass_counts"].get("lower_fp8_matmuls", {})


def final(losses) -> float:
    return sum(losses[-10:]) / 10


def train_fp8(name: str, scaling: str) -> tuple[tuple[float, ...], dict]:
    options = {"fp8_min_dim": 16, "fp8_scaling": scaling, **RECIPES[scaling]}
    return train(name, "fp8", tuple(sorted(options.items())))


@pytest.mark.slow   # 4-10 s per model and recipe on 2 busy cores (bf16's and current's runs shared)
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_200_steps_at_fp8_end_within_the_margin_of_bf16(name, scaling):
    bf16, _ = train(name, "O1", (("dtype", torch.bfloat16),))
    fp8, counts = train_fp8(name, scaling)
    assert counts.get("fp8", 0) >= FP8_MATMULS[name], counts
    assert fp8 != bf16, "every loss equals bf16's: fp8 did not run"
    if scaling != "current":
        assert fp8 != train_fp8(name, "current")[0], f"every loss equals current scaling's: {scaling} did not apply"
    assert final(fp8) < TRAINED[name] * fp8[0], f"fp8 did not train: {fp8[0]:.4f} -> {final(fp8):.4f}"
    assert final(bf16) < TRAINED[name] * bf16[0], f"bf16 did not train: {bf16[0]:.4f} -> {final(bf16):.4f}"
    gap = abs(final(fp8) - final(bf16))
    assert gap <= MARGIN[name], f"{name} {scaling}: fp8 {final(fp8):.4f}, bf16 {final(bf16):.4f}: gap {gap:.4f}"
