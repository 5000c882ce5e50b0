"""O2 as Apex defines it: the weights only low-precision ops read are stored low, the optimizer steps fp32
masters, and no forward casts a weight.

    gm = amp_compiler.convert(model, "O2", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())      # steps the fp32 weights: the masters
    weights = amp_compiler.low_weights(gm, optimizer)       # gm now holds bf16 copies of them
    loss_fn(gm(x), y).backward()                            # gradients arrive bf16, are added into master.grad (fp32)
    optimizer.step()                                        # remakes the copies (one fused copy)

Which weights: the fp32 parameters the optimizer holds (requires_grad) whose every read in gm's graph is a cast
to the low dtype. The others (norm weights, a weight an fp32 op also reads, parameters of leaf modules) stay fp32
and are cast where read, as before. The user's model keeps its fp32 parameters: they are the masters.
- Gradients: at the end of each backward the copies' gradients are added into the masters' .grad in fp32, one
  fused operation per device, and the copies' .grad cleared; clipping, GradScaler.unscale_ and accumulation over
  micro-batches (summed in fp32) see master gradients as for an fp32 model. Under DistributedDataParallel the
  all-reduce moves the low gradients (half of fp32's bytes); inside no_sync() they stay on the copies (DDP sums
  them there, low) and fold on the synchronising backward, after DDP's all-reduce.
- Copies: after each optimizer step all copies are remade in one fused copy (a skipped step, on overflow, does
  not call step(): no copy changes); before each forward, the copies of masters whose version counter or storage
  moved otherwise (load_state_dict, an in-place edit under no_grad). A write through `.data` moves no version
  counter: call `weights.refresh()` after one.
- Checkpoints: gm.state_dict() holds the masters' fp32 values, gm.load_state_dict() writes the masters.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.autograd import Variable

from amp_compiler.passes.fx.runtime import is_cast

LOW = (torch.float16, torch.bfloat16)


@dataclass(eq=False)   # compared by identity: its fields are tensors
class _Pair:
    master: nn.Parameter          # the user's fp32 parameter, stepped by the optimizer
    low: nn.Parameter             # what gm holds and its graph reads
    names: list[str]              # its names in gm (a tied weight has several)
    seen: tuple = ()              # the master's (version, data_ptr) when `low` was last made from it

    def current(self) -> tuple:
        return self.master._version, self.master.data_ptr()


class LowWeights:
    """The low copies of `gm`'s weights and their fp32 masters; see the module docstring. `remove()` puts the
    masters back into gm and drops the hooks."""

    def __init__(self, gm: fx.GraphModule, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        self.gm, self.dtype = gm, dtype
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.pairs = [_Pair(master, _low_copy(master, dtype), names)
                      for master, names in _weights_read_only_low(gm, dtype)
                      if id(master) in in_optimizer and master.requires_grad]
        self._by_low = {id(pair.low): pair for pair in self.pairs}
        for pair in self.pairs:
            pair.seen = pair.current()
            for name in pair.names:
                owner, leaf = _owner(gm, name)
                owner._parameters[leaf] = pair.low
        self._fold_queued = False
        self._fold_after_backward = True
        self.driven_by_step = False   # build_train_network's step refreshes itself and traces gm: no hooks then
        self._ranks_agreed = False
        self._handles = [pair.low.register_post_accumulate_grad_hook(self._gradient_arrived)
                         for pair in self.pairs]
        # After a real step, all copies at once: a fused optimizer (AdamW(fused=True) on CPU) writes the masters
        # without moving their version counters. A skipped step never calls step(), so nothing is remade.
        self._handles += [optimizer.register_step_post_hook(lambda *a: self.refresh(only_stale=False)),
                          gm.register_forward_pre_hook(self._before_forward),
                          # (functions, not bound methods: torch marks the hooks with an attribute)
                          gm.register_state_dict_post_hook(lambda *a: self._masters_in_state_dict(*a)),
                          gm.register_load_state_dict_pre_hook(lambda *a: self._load_into_masters(*a))]
        gm.__dict__["_amp_low_weights"] = self

    # -- copies ------------------------------------------------------------------------------------------
    def refresh(self, only_stale: bool = True) -> int:
        """Remake the copies whose master changed (all of them with only_stale=False); returns how many."""
        stale = [pair for pair in self.pairs if not only_stale or pair.seen != pair.current()]
        if stale:
            with torch.no_grad():
                for device_pairs in _by_device(stale):
                    torch._foreach_copy_([p.low for p in device_pairs], [p.master for p in device_pairs])
            for pair in stale:
                pair.seen = pair.current()
        return len(stale)

    def _before_forward(self, module, args) -> None:
        if self.driven_by_step:
            return
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:   # DDP all-reduces only when it synchronises: inside no_sync() keep the copies' grads
            self._fold_after_backward = bool(ddp.require_backward_grad_sync)
            if not self._ranks_agreed:
                self._take_rank0_masters()
        self.refresh()

    def _take_rank0_masters(self) -> None:
        """DDP broadcast rank 0's low copies when it was built; the masters must follow, or each rank would
        step its own masters and the copies would drift apart after the first step."""
        with torch.no_grad():
            for pair in self.pairs:
                dist.broadcast(pair.master, src=0)
        self._ranks_agreed = True
        self.refresh(only_stale=False)

    # -- gradients ---------------------------------------------------------------------------------------
    def _gradient_arrived(self, low: torch.Tensor) -> None:
        if not self._fold_queued:   # once per backward; the fold itself runs after DDP's own end-of-backward work
            self._fold_queued = True
            Variable._execution_engine.queue_callback(
                lambda: Variable._execution_engine.queue_callback(self._fold_at_end_of_backward))

    def _fold_at_end_of_backward(self) -> None:
        self._fold_queued = False
        if self._fold_after_backward:
            self.fold_gradients()

    def fold_gradients(self) -> int:
        """Add the copies' gradients into the masters' .grad (fp32) and clear them; returns how many."""
        arrived = [pair for pair in self.pairs if pair.low.grad is not None]
        with torch.no_grad():
            for device_pairs in _by_device(arrived):
                fresh = [p for p in device_pairs if p.master.grad is None]   # after zero_grad(): copy, not add
                for pair in fresh:
                    pair.master.grad = torch.empty_like(pair.master, memory_format=torch.preserve_format)
                if fresh:
                    torch._foreach_copy_([p.master.grad for p in fresh], [p.low.grad for p in fresh])
                adding = [p for p in device_pairs if p not in fresh]
                if adding:
                    torch._foreach_add_([p.master.grad for p in adding], [p.low.grad for p in adding])
        for pair in arrived:
            pair.low.grad = None
        return len(arrived)

    # -- checkpoints -------------------------------------------------------------------------------------
    def _masters_in_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        for pair in self.pairs:
            for name in pair.names:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = pair.master.detach()

    @torch.no_grad()
    def _load_into_masters(self, module, state_dict, prefix, *rest) -> None:
        for pair in self.pairs:
            value = state_dict.get(prefix + pair.names[0])
            if isinstance(value, torch.Tensor) and value.shape == pair.master.shape:
                pair.master.copy_(value)   # gm's own load then writes the copy from the same value

    # -- the rest ----------------------------------------------------------------------------------------
    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a low copy gm holds; any other parameter is its own master."""
        pair = self._by_low.get(id(param))
        return param if pair is None else pair.master

    def nbytes(self) -> int:
        """What the copies cost (bytes): the price of casting no weight in the forward."""
        return sum(pair.low.numel() * pair.low.element_size() for pair in self.pairs)

    def remove(self) -> None:
        """Put the fp32 masters back into gm (its graph casts them again) and drop every hook."""
        self.fold_gradients()
        for handle in self._handles:
            handle.remove()
        for pair in self.pairs:
            for name in pair.names:
                owner, leaf = _owner(self.gm, name)
                owner._parameters[leaf] = pair.master
        self.gm.__dict__.pop("_amp_low_weights", None)
        self.pairs, self._by_low = [], {}

    def __repr__(self) -> str:
        stored = sum(pair.low.numel() for pair in self.pairs)
        return (f"LowWeights({len(self.pairs)} weights stored {str(self.dtype).replace('torch.', '')}, "
                f"{stored:,} values, {self.nbytes() / 2**20:.1f} MiB of copies)")


def low_weights(gm: fx.GraphModule, optimizer: torch.optim.Optimizer) -> LowWeights:
    """Store `gm`'s low-read weights low, with the optimizer's fp32 parameters as their masters (see above).
    Call it after building the optimizer and before wrapping gm in DistributedDataParallel."""
    if getattr(gm, "__dict__", {}).get("_amp_in_place") is not None:
        raise TypeError("low_weights() takes the GraphModule convert(model, level) returns; for a model converted "
                        "in place use amp_compiler.initialize(model, optimizer, opt_level='O2') (Apex's O2: "
                        "the model's weights low, fp32 masters in the optimizer)")
    if not isinstance(gm, fx.GraphModule) or "amp" not in gm.meta:
        raise TypeError(f"low_weights() takes the GraphModule amp_compiler.convert(model, 'O2') returns, got "
                        f"{type(gm).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if "_amp_low_weights" in gm.__dict__:
        raise RuntimeError("low_weights() already ran on this GraphModule: use the LowWeights it returned "
                           "(gm.__dict__['_amp_low_weights']), or call its remove() first")
    dtype = getattr(torch, gm.meta["amp"]["dtype"])
    weights = LowWeights(gm, optimizer, dtype)
    if not weights.pairs:
        weights.remove()
        raise ValueError(f"no weight of this graph is read only by {dtype} ops, or none of those is in the "
                         f"optimizer: convert at O2 or O3 (level here: {gm.meta['amp']['level']}) and build the "
                         "optimizer from model.parameters()")
    return weights


def _weights_read_only_low(gm: fx.GraphModule, dtype: torch.dtype) -> list[tuple[nn.Parameter, list[str]]]:
    """fp32 parameters every graph read of which is a cast to `dtype`, with their names in gm."""
    reads: dict[int, list[fx.Node]] = {}
    read_otherwise: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, nn.Parameter):
                reads.setdefault(id(value), []).append(node)
            elif isinstance(value, nn.Module):   # a module handed to a runtime helper reads its parameters
                read_otherwise.update(id(p) for p in value.parameters())
        elif node.op == "call_module":
            read_otherwise.update(id(p) for p in gm.get_submodule(node.target).parameters())
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(params[key], names[key]) for key, nodes in reads.items()
            if key not in read_otherwise and params.get(key) is not None
            and params[key].dtype == torch.float32 and all(_only_cast_low(node, dtype) for node in nodes)]


def _only_cast_low(node: fx.Node, dtype: torch.dtype) -> bool:
    return bool(node.users) and all(is_cast(user) and user.args[0] is node and len(user.args) > 1
                                    and user.args[1] == dtype for user in node.users)


def _low_copy(master: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(master.detach().to(dtype), requires_grad=True)


def _owner(gm: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), leaf


def _by_device(pairs: list[_Pair]) -> list[list[_Pair]]:
    groups: dict[torch.device, list[_Pair]] = {}
    for pair in pairs:
        groups.setdefault(pair.master.device, []).append(pair)
    return list(groups.values())
