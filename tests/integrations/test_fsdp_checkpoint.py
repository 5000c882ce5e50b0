"""Sharded checkpoints under FSDP2 in a plain loop (issue 32), two gloo ranks: a converted model (one graph sharded at
the root, converted per block, converted in place on dynamo and sharded per block) at fp8 with delayed scaling,
Adam and a dynamic loss-scale manager, trained 2 steps, saved with torch.distributed.checkpoint
(save_sharded_checkpoint), loaded into a model, optimizer and manager built from scratch, trained 2 more steps, ends
where 4 uninterrupted steps end: every parameter shard, Adam's state, the loss scale and this rank's amax histories
equal, bit for bit (the same ops on the same values in the same order: one thread, fixed batches).

The ranks' batches differ in size (rank 1's are 10x rank 0's), so their amax histories do: DCP's own recipe saves a
plain tensor once (rank 0's) and a resumed rank 1 would scale from rank 0's amaxes; in place, get_state_dict
refuses the histories' keys (no attributes of the model)."""
import pytest
import torch
from torch import nn

from amp_compiler import DynamicLossScaleManager, convert
from amp_compiler.train.sharded_checkpoint import is_history_key, load_sharded_checkpoint, save_sharded_checkpoint
from distributed_testing import WORLD_SIZE, run_on_two_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

WIDTH = 16   # fp8 lowers a matmul whose K and N are multiples of 16 (fp8_min_dim=16)
FP8 = dict(fp8_scaling="delayed", fp8_history=4, fp8_min_dim=16)
FP8_LINEARS = {"whole": 4, "per_block": 2, "in_place": 4}   # kind -> linears lowered to fp8 (per block: the blocks')


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x))) + x


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks = nn.Linear(WIDTH, WIDTH), nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, WIDTH, generator=generator) * 10 ** rank, torch.randint(0, WIDTH, (16,), generator=generator)


def built(kind, rank):
    """A model converted and sharded as `kind` says, its Adam and manager, from scratch (seeded)."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = BlockNet()
    if kind == "whole":
        model = convert(model, "fp8", example_inputs=(batch(rank, 0)[0],), **FP8)
    elif kind == "per_block":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = convert(block, "fp8", example_inputs=(batch(rank, 0)[0],), **FP8)
    else:
        model = convert(model, "fp8", inplace=True, **FP8)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    if kind != "whole":
        for block in model.blocks:
            fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    # scale_window=1: the scale doubles every clean step, so a resumed manager must carry it over
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), DynamicLossScaleManager(2.0 ** 8, scale_window=1)


def train(model, optimizer, manager, rank, steps):
    for step in steps:
        x, y = batch(rank, step)
        optimizer.zero_grad()
        manager.scale(nn.functional.cross_entropy(model(x).float(), y)).backward()
        manager.step(optimizer)
        manager.update()
        assert not manager.last_overflow


def histories(model):
    """This rank's amax histories, by state_dict key (an in-place model's come from its store's hook)."""
    return {key: value.clone() for key, value in model.state_dict().items() if is_history_key(key)}


def local_state(model, optimizer, manager):
    shards = [p.to_local().clone() for p in model.parameters()]
    adam = [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for s in optimizer.state.values() for v in s.values()]
    return shards, adam, manager.get_loss_scale(), histories(model)


def assert_same(resumed, uninterrupted, kind):
    for name, (got, want) in zip(("parameter shards", "Adam state"), zip(resumed[:2], uninterrupted[:2])):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), f"{kind}: {name} differ"
    assert resumed[2] == uninterrupted[2], f"{kind}: loss scale {resumed[2]} resumed, {uninterrupted[2]} uninterrupted"
    assert resumed[3].keys() == uninterrupted[3].keys(), kind
    off = [key for key in resumed[3] if not torch.equal(resumed[3][key], uninterrupted[3][key])]
    assert not off, f"{kind}: amax histories differ from the uninterrupted run's: {off}"


def check_resumed_run_ends_where_the_uninterrupted_one_ends(rank, root):
    from distributed_testing import gathered
    for kind, linears in FP8_LINEARS.items():
        model, optimizer, manager = built(kind, rank)
        train(model, optimizer, manager, rank, range(4))
        uninterrupted = local_state(model, optimizer, manager)
        assert len(uninterrupted[3]) == 3 * linears, f"{kind}: {sorted(uninterrupted[3])}"   # x, w, grad each
        x_history = next(v for k, v in uninterrupted[3].items() if k.endswith(".x"))
        assert x_history.count_nonzero() == 4   # recorded on every step
        other = gathered(x_history)[1 - rank]
        assert not torch.equal(x_history, other), f"{kind}: both ranks hold the same histories"

        model, optimizer, manager = built(kind, rank)
        train(model, optimizer, manager, rank, range(2))
        path = f"{root}/{kind}"
        save_sharded_checkpoint(path, model, optimizer, manager)
        del model, optimizer, manager

        model, optimizer, manager = built(kind, rank)
        load_sharded_checkpoint(path, model, optimizer, manager)
        assert manager.get_loss_scale() == 2.0 ** 10
        train(model, optimizer, manager, rank, range(2, 4))
        assert_same(local_state(model, optimizer, manager), uninterrupted, kind)


def check_in_tmp(rank):
    import os
    check_resumed_run_ends_where_the_uninterrupted_one_ends(rank, os.environ["AMP_TEST_CHECKPOINT_ROOT"])


def test_sharded_checkpoint_resumes_where_the_uninterrupted_run_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TEST_CHECKPOINT_ROOT", str(tmp_path))   # spawned ranks inherit the environment
    run_on_two_ranks(check_in_tmp)
