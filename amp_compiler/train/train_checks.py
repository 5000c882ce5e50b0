"""What build_train_network refuses before converting anything, each with what to do instead."""
from __future__ import annotations

import torch
from torch import nn

SEED_METHODS = ("get_loss_scale", "update_loss_scale", "get_drop_overflow_update")


def check_train_arguments(model, optimizer, loss_fn) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_train_network needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, label), got {type(loss_fn).__name__}")
    _check_not_sharded(model)
    _check_optimizer_holds_model(model, optimizer)


def check_loss_scale_manager(manager) -> None:
    """None (no scaling) or anything with the seeds' three methods."""
    missing = [m for m in SEED_METHODS if not callable(getattr(manager, m, None))]
    if manager is not None and missing:
        raise TypeError(f"loss_scale_manager must be a LossScaleManager (it lacks {', '.join(missing)}), "
                        f"got {type(manager).__name__}")


def _check_not_sharded(model: nn.Module) -> None:
    """FSDP gathers a block's parameters only around that block's own forward/backward hooks, which the
    traced step never calls: the step would read the shards. Say so, and what works instead."""
    from torch.distributed import fsdp
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None), fsdp.FullyShardedDataParallel) if k)
    sharded = [name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, kinds)]
    if sharded:
        raise TypeError(
            f"build_train_network does not take a model sharded with FSDP (fully_shard on {sharded[:3]}): its "
            "one traced step reads every parameter whole, while FSDP gathers a block's shards only around that "
            "block's own forward and backward. Convert, shard, then train in a plain loop: gm = "
            "amp_compiler.convert(model, level); fully_shard(gm); scaler = amp_compiler.DynamicLossScaleManager(); "
            "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() (every rank skips together)")


def _check_optimizer_holds_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_params = {id(p): (name, p) for name, p in model.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    mine = [model_params[id(p)] for p in held if id(p) in model_params]
    if not mine:
        raise ValueError(f"the optimizer holds none of the model's parameters ({len(held)} tensor(s), none of "
                         f"them a parameter of {type(model).__name__}): build it from model.parameters()")
    low = [(name, p.dtype) for name, p in mine if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise ValueError(f"parameter(s) {[name for name, _ in low[:3]]} are {low[0][1]}: the master weights "
                         "must stay fp32 (do not call .half() on the model; the step makes the "
                         "low-precision copies inside its graph)")
