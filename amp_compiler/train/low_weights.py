"""O2 as Apex defines it: the weights only low-precision ops read are stored low, the optimizer steps fp32
masters, and no forward casts a weight. The mechanism itself is MasterWeights below: pairs of (low tensor the graphs
read, fp32 master the optimizer steps), the copy master -> low after a step, the gradient fold low -> master. Its two
front ends: low_weights() (LowWeights: a GraphModule of convert()'s gets new low copies, the user's parameters are
the masters) and Apex's amp.initialize at O2 (amp_compiler/apex.py, OptimizerStash: the model's own parameters are
cast low in place and new fp32 masters go into the optimizer).

    gm = amp_compiler.convert(model, "O2", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())      # steps the fp32 weights: the masters
    weights = amp_compiler.low_weights(gm, optimizer)       # gm now holds bf16 copies of them
    loss_fn(gm(x), y).backward()                            # gradients arrive bf16, are added into master.grad (fp32)
    optimizer.step()                                        # remakes the copies (one fused copy)

Which weights: the fp32 parameters the optimizer holds (requires_grad) whose every read in gm's graph is a cast
to the low dtype. The others (norm weights, a weight an fp32 op also reads, parameters of leaf modules) stay fp32
and are cast where read, as before. The user's model keeps its fp32 parameters: they are the masters. A model
convert() runs as written with converted children: the weights of every child's graph, as above; a parameter
held by its modules outside those graphs is read by code as written and stays fp32.
- Gradients: at the end of each backward the copies' gradients are added into the masters' .grad in fp32, one
  fused operation per device, and the copies' .grad cleared; clipping, GradScaler.unscale_ and accumulation over
  micro-batches (summed in fp32) see master gradients as for an fp32 model. Under DistributedDataParallel the
  all-reduce moves the low gradients (half of fp32's bytes); inside no_sync() they stay on the copies (DDP sums
  them there, low) and fold on the synchronising backward, after DDP's all-reduce.
- Copies: after each optimizer step all copies are remade in one fused copy (a skipped step, on overflow, does
  not call step(): no copy changes); before each forward, the copies of masters whose version counter or storage
  moved otherwise (load_state_dict, an in-place edit under no_grad). A write through `.data` moves no version
  counter: call `weights.refresh()` after one.
- Checkpoints: gm.state_dict() holds the masters' fp32 values, gm.load_state_dict() writes the masters;
  deepcopy(gm) (an EMA model) gets fp32 parameters holding the masters' values; torch.save(gm) is refused
  (it would save the copies): save gm.state_dict().
- Each forward checks that gm still holds the copies (FSDP's fully_shard or to_empty() replace them: raised),
  that a wrapping DDP watches them (DDP built before low_weights() would all-reduce nothing: raised), follows
  the masters' requires_grad, and, when convert() switched graphs with the train/eval mode, puts back the fp32
  master of any weight the new graph reads otherwise than through a low cast.
- Use the masters (the user's model.parameters()) for clipping, EMA and new optimizers: gm.parameters() yields
  the copies, whose .grad is cleared at each fold.
"""
from __future__ import annotations

import contextlib
import operator
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook

from amp_compiler.passes.fx.runtime import is_cast

ATTRIBUTE = "_amp_low_weights"


# -- the one O2 mechanism -----------------------------------------------------------------------------------
@dataclass(eq=False)   # compared by identity: its fields are tensors
class MasterPair:
    low: nn.Parameter             # what the model holds and its graphs read (fp16/bf16)
    master: torch.Tensor          # its fp32 master: what the optimizer steps


class MasterWeights:
    """O2's (low tensor, fp32 master) pairs and the two moves between them: after an optimizer step the masters
    are copied into the lows (one fused copy per device); after a backward the lows' gradients are folded into the
    masters' .grad in fp32 (unscaled on the way when a loss scaler's 1/scale is given, the inf/nan check in the
    same fused kernel). LowWeights below and apex.OptimizerStash are built on it; when they fold, and whether a
    step may be skipped, stays theirs (see each)."""

    def __init__(self) -> None:
        self.pairs: list = []
        self._by_low: dict[int, MasterPair] = {}
        self._masters: set[int] = set()

    def add_pair(self, pair: MasterPair) -> MasterPair:
        self.pairs.append(pair)
        self._by_low[id(pair.low)] = pair
        self._masters.add(id(pair.master))
        return pair

    def _forget(self, pair: MasterPair) -> None:
        self.pairs = [p for p in self.pairs if p is not pair]
        self._by_low.pop(id(pair.low), None)
        self._masters.discard(id(pair.master))

    def pair_of(self, low: torch.Tensor) -> MasterPair | None:
        return self._by_low.get(id(low))

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a low tensor held here; any other parameter is its own master."""
        pair = self._by_low.get(id(param))
        return param if pair is None else pair.master

    def holds_a_master(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._masters for group in optimizer.param_groups for p in group["params"])

    # -- master -> low -------------------------------------------------------------------------------------
    def copy_masters_to_low(self, pairs: list | None = None) -> int:
        """Remake the lows of `pairs` (all by default) from their masters; returns how many."""
        pairs = self.pairs if pairs is None else pairs
        fused_copy_([p.low for p in pairs], [p.master for p in pairs])
        return len(pairs)

    def copy_after_steps(self, optimizer: torch.optim.Optimizer | None = None):
        """Copy after each real step of `optimizer` (a step post-hook it holds) or, given None, of any optimizer
        that holds one of the masters (a global post-hook). A step skipped on overflow calls no step(), so it
        copies nothing. Returns the hook's handle."""
        me, every = weakref.ref(self), optimizer is None

        def stepped(stepping, *_):
            if (weights := me()) is not None and (not every or weights.holds_a_master(stepping)):
                weights._stepped()
        return register_optimizer_step_post_hook(stepped) if every else optimizer.register_step_post_hook(stepped)

    def _stepped(self) -> None:
        self.copy_masters_to_low()

    # -- low -> master -------------------------------------------------------------------------------------
    def fold(self, inv_scale: float | None = None, clear_low: bool = True) -> tuple[int, bool]:
        """Add the lows' gradients into their masters' .grad in fp32 (a copy where a master has none, after
        zero_grad), times `inv_scale` when given; with clear_low, every low's .grad is cleared after (a frozen
        master's low's too). Returns (how many arrived, whether any was inf/nan: checked when unscaling)."""
        arrived = [pair for pair in self.pairs if pair.low.grad is not None and pair.master.requires_grad]
        adding = [pair for pair in arrived if pair.master.grad is not None]
        fresh = [pair for pair in arrived if pair.master.grad is None]
        for pair in fresh:
            pair.master.grad = torch.empty_like(pair.master, memory_format=torch.preserve_format)
        fused_copy_([p.master.grad for p in fresh], [p.low.grad for p in fresh])
        # added as they are (_foreach_add_ casts them up), or cast up first to be unscaled before the sum
        added = [p.low.grad if inv_scale is None else p.low.grad.float() for p in adding]
        found = inv_scale is not None and unscale_([p.master.grad for p in fresh] + added, inv_scale)
        with torch.no_grad():
            by_device: dict[torch.device, tuple[list, list]] = {}
            for pair, grad in zip(adding, added):
                group = by_device.setdefault(pair.master.device, ([], []))
                group[0].append(pair.master.grad)
                group[1].append(grad)
            for targets, grads in by_device.values():
                torch._foreach_add_(targets, grads)
        if clear_low:
            for pair in self.pairs:
                pair.low.grad = None
        return len(arrived), found

    # -- checkpoints: the module's state_dict holds the masters, load_state_dict writes them ----------------
    def masters_in_state_dict(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        for name, param in module.named_parameters(remove_duplicate=False):
            pair = self._by_low.get(id(param))
            if pair is not None and prefix + name in state_dict:
                state_dict[prefix + name] = pair.master.detach()

    @torch.no_grad()
    def load_into_masters(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        for name, param in module.named_parameters(remove_duplicate=False):
            pair = self._by_low.get(id(param))   # a tied weight: every name given loads, in order, as into one
            value = state_dict.get(prefix + name)
            if pair is not None and isinstance(value, torch.Tensor) and value.shape == pair.master.shape:
                pair.master.copy_(value)   # the module's own load then writes the low from the same value


def unscale_(grads: list[torch.Tensor], inv_scale: float) -> bool:
    """Multiply fp32 gradients by 1/scale in place (the fused kernel GradScaler uses); any inf/nan?"""
    found = False
    by_device: dict = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, group in by_device.items():
        flag = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, torch.full((), inv_scale, device=device))
        found = found or bool(flag.item())
    return found


# -- low_weights(gm, optimizer) -----------------------------------------------------------------------------
@dataclass(eq=False)
class _Pair(MasterPair):
    """low: what gm holds and its graph reads; master: the user's fp32 parameter, stepped by the optimizer."""
    names: list[str] = field(default_factory=list)   # its names in gm (a tied weight has several)
    seen: tuple = ()              # the master's (version, data_ptr) when `low` was last made from it
    hook: object = None           # the copy's post-accumulate-grad hook
    slots: list = field(default_factory=list)   # (owner module's _parameters, name): where gm holds it

    def current(self) -> tuple:
        return self.master._version, self.master.data_ptr()


class LowWeights(MasterWeights):
    """The low copies of `gm`'s weights and their fp32 masters; see the module docstring. `remove()` puts the
    masters back into gm and drops the hooks. The gradients fold at the end of each backward (no unscaling: a
    GradScaler unscales the masters' .grad after), the copies are remade after any optimizer's step that holds
    a master, and before a forward where a master moved otherwise."""

    def __init__(self, gm: fx.GraphModule, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        super().__init__()
        self.gm, self.dtype = gm, dtype
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        only_low, _ = _graph_reads(gm, dtype)
        for param, names in _named_params(gm):
            if id(param) in only_low and param.dtype == torch.float32 and id(param) in in_optimizer \
                    and param.requires_grad:
                self.add_pair(_Pair(low=_low_copy(param, dtype), master=param, names=names))
        self._graph = _graphs_of(gm)      # the graphs analysed; a train/eval switch brings in others
        self._fold_task = None            # the autograd graph task whose end-of-backward fold is queued
        self._fold_after_backward = True  # False inside DDP's no_sync()
        self._paused = 0
        self._ddp_checked: set[int] = set()
        self._ranks_agreed = False
        for pair in self.pairs:
            pair.seen = pair.current()
            pair.slots = _put(gm, pair.names, pair.low)
            pair.hook = pair.low.register_post_accumulate_grad_hook(self._gradient_arrived)
        # After any optimizer's real step that holds a master (one built later from the masters too): a fused
        # optimizer (AdamW(fused=True) on CPU) writes the masters without moving their version counters.
        self._handles = [self.copy_after_steps(),
                         gm.register_forward_pre_hook(_before_forward),
                         gm.register_state_dict_post_hook(_masters_in_state_dict),
                         gm.register_load_state_dict_pre_hook(_load_into_masters)]
        # first in gm's __dict__, so that deepcopy(gm) meets it before the parameters (see __deepcopy__)
        entries = dict(gm.__dict__)
        gm.__dict__.clear()
        gm.__dict__.update({ATTRIBUTE: self, **entries})

    # -- copies ------------------------------------------------------------------------------------------
    def refresh(self, only_stale: bool = True) -> int:
        """Remake the copies whose master changed (all of them with only_stale=False); returns how many."""
        stale = [pair for pair in self.pairs if not only_stale or pair.seen != pair.current()]
        if stale:
            self.copy_masters_to_low(stale)
            for pair in stale:
                pair.seen = pair.current()
        return len(stale)

    def _stepped(self) -> None:
        self.refresh(only_stale=False)

    @contextlib.contextmanager
    def paused(self):
        """No forward-hook work: build_train_network traces gm with fake tensors and refreshes itself."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def before_forward(self) -> None:
        if self._paused:
            return
        if _switched(self._graph, _graphs_of(self.gm)):   # convert() switched graphs with the train/eval mode
            self._follow_graph()
        for pair in self.pairs:
            if any(owner.get(leaf) is not pair.low for owner, leaf in pair.slots):
                raise RuntimeError(
                    f"{pair.names[0]} of the converted graph is no longer the low copy low_weights() put there "
                    "(FSDP's fully_shard, to_empty() or an assignment replaced it): the masters would stop "
                    "training. Call weights.remove() first and low_weights() after, or shard without it")
            if pair.low.requires_grad != pair.master.requires_grad:   # the user froze or unfroze the master
                pair.low.requires_grad_(pair.master.requires_grad)
        if self._fold_task is not None and torch._C._current_graph_task_id() == -1:
            self._drop_unfolded()
        ddp = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:
            self._under(ddp)
        self.refresh()

    def _follow_graph(self) -> None:
        """Weights the new graph reads otherwise than through a low cast go back to fp32 masters in gm."""
        _, read_otherwise = _graph_reads(self.gm, self.dtype)
        for pair in [pair for pair in self.pairs if id(pair.low) in read_otherwise]:
            self._release(pair)
        self._graph = _graphs_of(self.gm)

    def _under(self, ddp) -> None:
        """DDP all-reduces only when it synchronises: inside no_sync() the copies keep their gradients."""
        if id(ddp) not in self._ddp_checked:
            watched = {id(p) for p in ddp._module_parameters}
            if any(id(pair.low) not in watched for pair in self.pairs):
                raise RuntimeError("DistributedDataParallel was built before low_weights(): it all-reduces the "
                                   "fp32 masters' gradients, which the forward no longer produces, so ranks "
                                   "would drift apart. Call low_weights(gm, optimizer) first, then wrap gm in DDP")
            self._ddp_checked.add(id(ddp))
        self._fold_after_backward = bool(ddp.require_backward_grad_sync)
        if not self._ranks_agreed:
            self._take_rank0_masters()

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
        task = torch._C._current_graph_task_id()
        if task != self._fold_task:   # once per backward; the fold runs after DDP's own end-of-backward work
            self._fold_task = task
            Variable._execution_engine.queue_callback(
                lambda: Variable._execution_engine.queue_callback(self._fold_at_end_of_backward))

    def _fold_at_end_of_backward(self) -> None:
        self._fold_task = None
        if self._fold_after_backward:
            self.fold_gradients()

    def _drop_unfolded(self) -> None:
        """A backward raised after some copies' gradients arrived, so neither its end nor its fold came: those
        partial gradients go (the masters' stay as they were) rather than join the next backward's."""
        dropped = [pair.names[0] for pair in self.pairs if pair.low.grad is not None]
        for pair in self.pairs:
            pair.low.grad = None
        self._fold_task = None
        if dropped:
            warnings.warn(f"a backward failed after gradients of {len(dropped)} stored weight(s) arrived "
                          f"({', '.join(dropped[:3])}): those were dropped, not added to the masters' .grad",
                          RuntimeWarning, stacklevel=4)

    def fold_gradients(self) -> int:
        """Add the copies' gradients into the masters' .grad (fp32) and clear them; returns how many."""
        return self.fold()[0]

    # -- the rest ----------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """What the copies cost (bytes): the price of casting no weight in the forward."""
        return sum(pair.low.numel() * pair.low.element_size() for pair in self.pairs)

    def _release(self, pair: _Pair) -> None:
        """Fold `pair`'s gradient, put its master back into gm, forget it."""
        self.fold_gradients()
        pair.hook.remove()
        _put(self.gm, pair.names, pair.master)
        self._forget(pair)

    def remove(self) -> None:
        """Put the fp32 masters back into gm (its graph casts them again) and drop every hook."""
        for pair in list(self.pairs):
            self._release(pair)
        for handle in self._handles:
            handle.remove()
        self.gm.__dict__.pop(ATTRIBUTE, None)

    def __deepcopy__(self, memo):
        """deepcopy(gm) (an EMA model, a snapshot) gets fp32 parameters holding the masters' values and casts
        them as before: its state_dict is fp32, and it shares nothing with this one."""
        for pair in self.pairs:
            memo.setdefault(id(pair.low), nn.Parameter(pair.master.detach().clone(),
                                                       requires_grad=pair.master.requires_grad))
        return None

    def __reduce_ex__(self, protocol):
        raise TypeError("torch.save/pickle of a GraphModule with stored low weights would save the low copies, "
                        "not the fp32 masters: save gm.state_dict() (it holds the masters), or call "
                        "weights.remove() first")

    def __repr__(self) -> str:
        stored = sum(pair.low.numel() for pair in self.pairs)
        return (f"LowWeights({len(self.pairs)} weights stored {str(self.dtype).replace('torch.', '')}, "
                f"{stored:,} values, {self.nbytes() / 2**20:.1f} MiB of copies)")


# gm's hooks: plain functions that find the LowWeights through the module (a deep copy of gm finds none)
def _weights_of(module) -> LowWeights | None:
    weights = module.__dict__.get(ATTRIBUTE)
    return weights if weights is not None and weights.gm is module else None


def _before_forward(module, args) -> None:
    if (weights := _weights_of(module)) is not None:
        weights.before_forward()


def _masters_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    if (weights := _weights_of(module)) is not None:
        weights.masters_in_state_dict(module, state_dict, prefix)


def _load_into_masters(module, state_dict, prefix, *rest) -> None:
    if (weights := _weights_of(module)) is not None:
        weights.load_into_masters(module, state_dict, prefix)


def low_weights(gm: fx.GraphModule, optimizer: torch.optim.Optimizer) -> LowWeights:
    """Store `gm`'s low-read weights low, with the optimizer's fp32 parameters as their masters (see above).
    Call it after building the optimizer and before wrapping gm in DistributedDataParallel."""
    from amp_compiler.converted import compiled_record
    if isinstance(gm, nn.Module) and compiled_record(gm) is not None:
        raise TypeError("low_weights() takes the GraphModule convert(model, level) returns; for a model converted "
                        "in place use amp_compiler.initialize(model, optimizer, opt_level='O2') (Apex's O2: "
                        "the model's weights low, fp32 masters in the optimizer)")
    if not isinstance(gm, nn.Module) or "amp" not in (gm.__dict__.get("meta") or {}):   # a graph, or run as written
        raise TypeError(f"low_weights() takes the GraphModule amp_compiler.convert(model, 'O2') returns, got "
                        f"{type(gm).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if ATTRIBUTE in gm.__dict__:
        raise RuntimeError(f"low_weights() already ran on this GraphModule: use the LowWeights it returned "
                           f"(gm.__dict__[{ATTRIBUTE!r}]), or call its remove() first")
    dtype = getattr(torch, gm.meta["amp"]["dtype"])
    weights = LowWeights(gm, optimizer, dtype)
    if not weights.pairs:
        weights.remove()
        raise ValueError(f"no weight of this graph is read only by {dtype} ops, or none of those is in the "
                         f"optimizer: convert at O2 or O3 (level here: {gm.meta['amp']['level']}) and build the "
                         "optimizer from model.parameters()")
    return weights


def _graph_reads(gm: nn.Module, dtype: torch.dtype) -> tuple[set[int], set[int]]:
    """(ids of parameters every graph read of which is a cast to `dtype`, ids of parameters read otherwise).
    A model convert() runs as written with converted children: the reads of every child's graph; a parameter
    its own modules outside those graphs hold is read by code as written (fp32, never a copy)."""
    reads: dict[int, list[fx.Node]] = {}
    read_otherwise: set[int] = set()
    graphs = _converted_graphs(gm)
    for graph_module in graphs:
        for node in graph_module.graph.nodes:
            if node.op == "get_attr":
                value = _attribute(graph_module, node.target)
                if isinstance(value, nn.Parameter):
                    reads.setdefault(id(value), []).append(node)
                elif isinstance(value, nn.Module):   # a module handed to a runtime helper reads its parameters
                    read_otherwise.update(id(p) for p in value.parameters())
            elif node.op == "call_module":
                read_otherwise.update(id(p) for p in graph_module.get_submodule(node.target).parameters())
    inside = {id(m) for graph_module in graphs for m in graph_module.modules()}
    read_otherwise.update(id(p) for m in gm.modules() if id(m) not in inside for p in m.parameters(recurse=False))
    only_low = {key for key, nodes in reads.items()
                if key not in read_otherwise and all(_only_cast_low(node, dtype) for node in nodes)}
    return only_low, read_otherwise | (set(reads) - only_low)


def _converted_graphs(module: nn.Module) -> list[fx.GraphModule]:
    """`module` itself when convert() returned a graph; else the outermost converted graphs inside it (a model
    run as written with its children converted: convert_children)."""
    if isinstance(module, fx.GraphModule):
        return [module]
    found, pending = [], list(module.children())
    while pending:
        child = pending.pop(0)
        if isinstance(child, fx.GraphModule) and "amp" in getattr(child, "meta", {}):
            found.append(child)
        else:
            pending += list(child.children())
    return found


def _graphs_of(module: nn.Module) -> list[fx.Graph]:
    return [graph_module.graph for graph_module in _converted_graphs(module)]


def _switched(before: list[fx.Graph], now: list[fx.Graph]) -> bool:
    return len(before) != len(now) or any(a is not b for a, b in zip(before, now))


def _only_cast_low(node: fx.Node, dtype: torch.dtype) -> bool:
    return bool(node.users) and all(is_cast(user) and user.args[0] is node and len(user.args) > 1
                                    and user.args[1] == dtype for user in node.users)


def _named_params(gm: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(params[key], names[key]) for key in params]


def _attribute(gm: nn.Module, target: str):
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def _put(gm: nn.Module, names: list[str], param: nn.Parameter) -> list[tuple[dict, str]]:
    """Make `param` what gm holds under each of `names`; returns where (owner's _parameters, leaf name)."""
    slots = []
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(prefix) if prefix else gm
        owner._parameters[leaf] = param
        slots.append((owner._parameters, leaf))
    return slots


def _low_copy(master: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(master.detach().to(dtype), requires_grad=True)


@torch.no_grad()
def fused_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) (casting) for all i, one fused copy per device."""
    by_device: dict[torch.device, tuple[list, list]] = {}
    for target, source in zip(targets, sources, strict=True):
        group = by_device.setdefault(target.device, ([], []))
        group[0].append(target)
        group[1].append(source)
    for device_targets, device_sources in by_device.values():
        torch._foreach_copy_(device_targets, device_sources)
