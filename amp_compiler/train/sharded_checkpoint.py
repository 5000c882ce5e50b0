"""Sharded checkpoints of a converted model trained under FSDP2 (or DDP), with torch.distributed.checkpoint (DCP).

    save_sharded_checkpoint(path, model, optimizer, manager)   # on every rank, at the same step
    load_sharded_checkpoint(path, model, optimizer, manager)   # on every rank, into objects built as before

This is DCP's own recipe (get_state_dict -> dcp.save; get_state_dict -> dcp.load -> set_state_dict) plus what a
converted model needs besides:
  - fp8 delayed-scaling amax histories are each rank's own: a rank records the amaxes of its own batches (as under
    DDP, tests/fp8/test_fp8_ddp.py). DCP takes a tensor that is not a DTensor for a replicated one and saves one copy
    (rank 0's), so every rank would resume from rank 0's histories. Here each rank's are saved apart, under
    fp8_histories.rank<r>.<its state_dict key>, and each rank loads its own; a checkpoint written by another number
    of ranks is refused.
  - in place (convert(..., inplace=True)) the histories' keys (<module>._amp_fp8_history.<x|w|grad>) are no
    attributes of the model, which get_state_dict refuses (AttributeError); they are left out of its state dict
    (Fp8HistoryStore.in_state_dict) and saved as above. A fresh in-place model holds no histories until its first
    call, so the keys to load are read from the checkpoint's metadata, and load_state_dict hands them to the
    model's store (the graphs captured later start from them).
  - the loss-scale manager's state_dict() (the same on every rank), under "loss_scale".
Saved: {"model": ..., "optimizer": ..., "loss_scale": ..., "fp8_histories": {"rank<r>": ...}, "world_size": n};
`path` is a directory (DCP's FileSystemWriter/Reader).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from amp_compiler.dynamo.compile import history_stores
from amp_compiler.dynamo.fp8_histories import STATE_NAME
from amp_compiler.passes.fx.fp8_runtime import HISTORIES
from amp_compiler.passes.fx.lower_fp8_matmuls import HISTORY_ROOT

HISTORIES_ENTRY = "fp8_histories"


def save_sharded_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            manager=None) -> None:
    """Save `model` (sharded or not), `optimizer`'s state and `manager`'s (a LossScaleManager) to directory `path`
    with DCP: each rank writes its shards and its own fp8 amax histories. Call it on every rank."""
    model_state, optimizer_state, histories = _states(model, optimizer)
    state = {"model": model_state, "world_size": _world_size(), HISTORIES_ENTRY: {_rank_entry(): histories}}
    if optimizer is not None:
        state["optimizer"] = optimizer_state
    if manager is not None:
        state["loss_scale"] = manager.state_dict()
    dcp.save(state, checkpoint_id=path)


def load_sharded_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            manager=None) -> None:
    """Load what save_sharded_checkpoint wrote into `model`, `optimizer` and `manager`, built (converted, sharded)
    as the saved ones were. Call it on every rank, before the first step."""
    model_state, optimizer_state, _ = _states(model, optimizer)
    histories = _saved_histories(path)
    state = {"model": model_state, "world_size": 0, HISTORIES_ENTRY: {_rank_entry(): histories}}
    if optimizer is not None:
        state["optimizer"] = optimizer_state
    if manager is not None:
        state["loss_scale"] = manager.state_dict()
    dcp.load(state, checkpoint_id=path)
    if state["world_size"] != _world_size():
        raise ValueError(f"{path} was saved by {state['world_size']} ranks, this run has {_world_size()}: each rank's "
                         "fp8 amax histories are its own and cannot be dealt out to another number of ranks")
    model_state.update(histories)   # under their own keys: load_state_dict (an in-place model's store) takes them
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state if optimizer is not None else {})
    if manager is not None:
        manager.load_state_dict(state["loss_scale"])


def is_history_key(key: str) -> bool:
    """Whether a state_dict key is an fp8 amax history: <gm>.fp8_history.<node>.<x|w|grad> of a converted
    GraphModule, or <module>._amp_fp8_history[...].<x|w|grad> of a model converted in place."""
    parts = key.split(".")
    return len(parts) >= 2 and parts[-1] in HISTORIES and (
        parts[-2].startswith(STATE_NAME) or (len(parts) >= 3 and parts[-3] == HISTORY_ROOT))


def _states(model: nn.Module, optimizer) -> tuple[dict, dict, dict]:
    """(get_state_dict's model state without the histories, its optimizer state, this rank's histories)."""
    stores = history_stores(model)
    with _left_out_of_state_dict(stores):
        model_state, optimizer_state = get_state_dict(model, [] if optimizer is None else optimizer)
    histories = {key: model_state.pop(key) for key in [k for k in model_state if is_history_key(k)]}
    for prefix, store in stores:
        histories.update({f"{prefix}{key}.{name}": tensor.detach() for key, tensors in store.tensors.items()
                          for name, tensor in tensors.items()})
    return model_state, optimizer_state, histories


@contextlib.contextmanager
def _left_out_of_state_dict(stores):
    for _, store in stores:
        store.in_state_dict = False
    try:
        yield
    finally:
        for _, store in stores:
            store.in_state_dict = True


def _saved_histories(path) -> dict[str, torch.Tensor]:
    """This rank's histories in the checkpoint, as empty tensors DCP loads into (read from its metadata: a model
    converted in place holds none before its first call)."""
    prefix = f"{HISTORIES_ENTRY}.{_rank_entry()}."
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in saved.items() if key.startswith(prefix)}


def _rank_entry() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
