"""fp8 delayed scaling inside DistributedDataParallel (two gloo ranks): each rank's amax histories are its own.
DDP broadcasts rank 0's buffers before every forward (broadcast_buffers=True, its default); the histories are
buffers, so every other rank scaled from rank 0's amaxes and never from its own: a rank whose activations are
10x rank 0's saturated at rank 0's amax on every step. lower_fp8_matmuls names them in the graph module's
_ddp_params_and_buffers_to_ignore."""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_compiler import convert
from distributed_testing import run_on_two_ranks


def check_each_rank_keeps_its_own_history(rank):
    torch.manual_seed(0)   # the same weights on every rank
    gm = convert(nn.Sequential(nn.Linear(32, 32)), "fp8", example_inputs=(torch.randn(4, 32),), fp8_min_dim=16,
                 fp8_scaling="delayed").train()
    ddp = DistributedDataParallel(gm)
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 32, generator=generator) * 10 ** rank for _ in range(3)]   # rank 1: 10x rank 0's
    for x in inputs:
        ddp(x).float().sum().backward()
    recorded = gm.fp8_history.linear.x[:3].tolist()   # rank 1 held [its last, rank 0's, rank 0's]
    assert recorded == [x.bfloat16().abs().max().item() for x in reversed(inputs)], (rank, recorded)

def test_each_rank_scales_from_its_own_amax_history():
    run_on_two_ranks(check_each_rank_keeps_its_own_history)
