"""Two ranks (gloo, loopback): build_train_network averages gradients and all-reduces the overflow flag,
and a converted GraphModule trains inside DistributedDataParallel with a loss-scale manager, also with its
weights stored low (low_weights: the all-reduce moves their low gradients)."""
import contextlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_compiler import DynamicLossScaleManager, build_train_network, convert, low_weights
from distributed_testing import WORLD_SIZE, gathered, run_on_two_ranks
from test_low_weights import batch as mlp_batch, make as make_mlp, params


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def assert_same_on_every_rank(model):
    for name, tensor in model.state_dict().items():
        if name.endswith("running_mean") or name.endswith("running_var"):
            continue  # BatchNorm statistics are per rank, as with DDP's own (non-synced) BatchNorm
        first, *others = gathered(tensor)
        assert all(torch.equal(first, other) for other in others), f"{name} differs between ranks"


def snapshot(model, optimizer):
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def check_build_train_network(rank):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_window=100)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype=torch.float16,
                               loss_scale_manager=manager)
    # The step's gradient is the average of each rank's fp32 gradient.
    reference = make_model()
    for other in range(WORLD_SIZE):
        x, y = batch(other, 0)
        nn.functional.cross_entropy(reference(x), y).backward()
    _, overflow, _ = step(*batch(rank, 0))
    assert not overflow
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad / WORLD_SIZE, rtol=2e-2, atol=2e-3)
    for index in range(1, 4):
        assert not step(*batch(rank, index))[1]
    assert_same_on_every_rank(model)
    # An overflow on rank 1 alone skips the step on both ranks.
    x, y = batch(rank, 4)
    if rank == 1:
        x[0, 0] = float("inf")
    before = snapshot(model, optimizer)
    _, overflow, scale = step(x, y)
    assert overflow, f"rank {rank} did not see rank 1's overflow"
    assert manager.get_loss_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
    assert not step(*batch(rank, 5))[1]
    assert_same_on_every_rank(model)


def check_converted_module_in_ddp_plain_loop(rank):
    model = make_model()
    ddp = DistributedDataParallel(convert(model, "O2", dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    manager = DynamicLossScaleManager(init_loss_scale=2 ** 8, scale_window=100)
    for index in range(6):
        x, y = batch(rank, index)
        optimizer.zero_grad()
        manager.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        if index == 3 and rank == 1:
            # After DDP's all-reduce: an overflow only this rank sees; the manager shares the flag.
            next(ddp.parameters()).grad[0, 0] = float("nan")
            before = snapshot(model, optimizer)
        if index == 3 and rank == 0:
            before = snapshot(model, optimizer)
        manager.step(optimizer)
        manager.update()
        assert manager.last_overflow == (index == 3), f"rank {rank} step {index}"
        if index == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
    assert manager.get_loss_scale() == 2 ** 7
    assert_same_on_every_rank(model)


def check_both(rank):
    check_build_train_network(rank)
    check_converted_module_in_ddp_plain_loop(rank)


@pytest.mark.slow
def test_two_ranks_train_identically_and_skip_overflow_together():
    run_on_two_ranks(check_both)


# -- O2 with weights stored low (amp_compiler/train/low_weights.py) under DDP ---------------------------------------------------------------------------------
def ddp_loop(rank: int, store: bool) -> list[torch.Tensor]:
    """3 optimizer steps of 2 micro-batches each (the first inside no_sync); rank 1 starts from other weights,
    which DDP's broadcast (and, for stored weights, the masters' broadcast) must overwrite."""
    from torch.nn.parallel import DistributedDataParallel
    model = make_mlp(seed=rank)
    gm = convert(model, "O2", dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if store:
        low_weights(gm, optimizer)
    ddp = DistributedDataParallel(gm)
    if not store:   # DDP broadcast gm's parameters, which are the masters here
        assert torch.equal(model.inp.weight, gathered(model.inp.weight)[0])
    for step in range(3):
        for k, context in enumerate((ddp.no_sync(), contextlib.nullcontext())):
            with context:
                x, y = mlp_batch(1000 * rank + 10 * step + k)
                nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params(model)


def check_ddp_with_stored_weights(rank):
    stored, casting = ddp_loop(rank, True), ddp_loop(rank, False)
    for tensor in stored:   # every rank holds the same masters, rank 1's own start overwritten
        first, other = gathered(tensor)
        assert torch.equal(first, other)
    start = params(make_mlp(seed=0))
    for a, b, s in zip(stored, casting, start, strict=True):
        # the updates agree to bf16 rounding of the all-reduced gradients; losing the no_sync micro-batch
        # (a fold before DDP synchronised) would halve them
        torch.testing.assert_close(a - s, b - s, rtol=0.05, atol=2e-3)


def test_ddp_all_reduces_low_gradients_and_folds_after_no_sync():
    run_on_two_ranks(check_ddp_with_stored_weights)
