"""build_train_network: a whole mixed-precision training step as one fx graph (the seeds' API).

    step = build_train_network(model, optimizer, loss_fn, level="O2", dtype=torch.float16)
    loss, overflow, loss_scale = step(x, y)        # the label comes last; overflow: Overflow.NONE/SKIPPED/APPLIED
    print(step.graph_module.code)                  # forward, fp32 loss, scaled backward, unscale, overflow check
    print(step.report())                           # steps applied and skipped, and why

Each call runs the joint graph traced for these input shapes and the model's train/eval flags (traced on
first sight, then cached), averages the gradients and the overflow flag over the process group when
torch.distributed is initialised, writes the fp32 unscaled gradients to param.grad, then steps the
optimizer, or on overflow skips it and puts back the BatchNorm statistics the forward had updated: the
parameters, the optimizer state and the buffers stay bit-identical and only the loss scale changes.
That skip is the rule at every level, with or without a manager, unless the manager says
drop_overflow_update=False; more than bad_step_max non-finite steps in a row raise (bad_steps.py).
A forward whose Python reads tensor values (what convert() runs as written with converted children: a
data-dependent top level, PyG's pooling without a size) cannot be traced with fake tensors: the same step runs
eagerly (joint_graph.EagerStep; report() says so and why), every buffer restored on a skipped step.
"""
from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Hashable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from amp_compiler.train.bad_steps import BAD_STEP_MAX, BadStepLimit
from amp_compiler.config import make_config
from amp_compiler.convert_model import convert
from amp_compiler.train.joint_graph import DATA_DEPENDENT, EagerStep, JointGraph, eager_step, trace_joint_graph
from amp_compiler.train.low_weights import LowWeights
from amp_compiler.train.loss_scale import FixedLossScaleManager, LossScaleManager, default_loss_scale_manager
from amp_compiler.train.step_outcome import Overflow, StepHistory
from amp_compiler.train.train_checks import check_loss_scale_manager, check_train_arguments

# Distinct (shapes, train/eval) signatures kept traced; the oldest is dropped beyond this.
MAX_CACHED_GRAPHS = 8


class TrainStep:
    """`loss, overflow, loss_scale = step(*inputs, label)`: one training step of `converted` (fp32 masters).

    `loss` is the unscaled fp32 loss (a 0-dim tensor), `overflow` an `Overflow`: falsy (NONE) when every
    gradient was finite, else SKIPPED (the update was dropped) or APPLIED (the manager says
    drop_overflow_update=False); `loss_scale` the scale this step used. `report()` sums the steps up.
    The step follows the train/eval mode of the model it was built from. It writes (never accumulates)
    param.grad, also on overflow, where the inf/nan show which gradients overflowed. Module attributes
    read by the forward (Dropout.p, ...) are fixed when a graph is traced: after changing one, call
    `clear_traced_graphs()`.
    """

    def __init__(self, model: nn.Module, converted: fx.GraphModule, optimizer: torch.optim.Optimizer,
                 loss_fn, loss_scale_manager, low_weights: LowWeights | None = None) -> None:
        self.model = model
        self.converted = converted
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.loss_scale_manager = loss_scale_manager
        # Without a manager (O0/O1/O3 by default) the step is unscaled; a non-finite update is still dropped.
        self._scaling = loss_scale_manager if loss_scale_manager is not None else \
            FixedLossScaleManager(1.0, drop_overflow_update=True)
        # Our managers count non-finite steps themselves; a custom one (the seeds' 3 methods) is counted here.
        self._bad_steps = None if isinstance(self._scaling, LossScaleManager) else \
            BadStepLimit(getattr(self._scaling, "bad_step_max", BAD_STEP_MAX))
        self.low_weights = low_weights   # O2: converted holds low copies, the optimizer steps fp32 masters
        self._master_of = low_weights.master_of if low_weights is not None else (lambda param: param)
        self.history = StepHistory()
        self.last_note = ""
        self._named_parameters = list(converted.named_parameters())
        self._named_buffers = list(converted.named_buffers())
        self._tensors_by_name = {**dict(self._named_parameters), **dict(self._named_buffers)}
        self._flag_pairs = _training_flag_pairs(model, converted)
        self._required_inputs, self._max_inputs = _input_arity(converted)
        self._graphs: OrderedDict[tuple, JointGraph] = OrderedDict()
        self._last: JointGraph | None = None
        self.num_traces = 0

    @property
    def graph_module(self) -> fx.GraphModule:
        """The joint graph of the latest step (or graph_for call)."""
        if self._last is None:
            raise RuntimeError("no step has run yet: the joint graph is traced for the shapes of the first "
                               "call; call step(*inputs, label) or step.graph_for(*inputs, label)")
        return self._last.graph_module

    def graph_for(self, *inputs_and_label) -> fx.GraphModule:
        """The joint graph for these inputs (traced if new), without running a step."""
        inputs, label = self._split(inputs_and_label)
        return self._joint_graph(inputs, label, self._trainable()).graph_module

    def __call__(self, *inputs_and_label) -> tuple[torch.Tensor, Overflow, float]:
        inputs, label = self._split(inputs_and_label)
        if self.low_weights is not None:
            self.low_weights.before_forward()   # the copies of masters changed since (load_state_dict, ...)
        trainable = self._trainable()
        joint = self._joint_graph(inputs, label, trainable)
        scale = float(self._scaling.get_loss_scale())
        drop_on_overflow = self._scaling.get_drop_overflow_update()
        mutated = [self._tensors_by_name[name] for name in joint.mutated_state] if drop_on_overflow else []
        before = [t.clone() for t in mutated]  # the BatchNorm statistics an overflow must give back
        state = self._state(trainable)
        tensors = [leaf for leaf in pytree.tree_leaves((inputs, label)) if isinstance(leaf, torch.Tensor)]
        with torch.no_grad():  # the graph holds the backward itself: no autograd tape around it
            loss, found_inf, *grads = joint.graph_module(*trainable.values(), *state.values(), *tensors,
                                                         torch.tensor(scale, dtype=torch.float32))
        grads, overflow = _synchronise(grads, found_inf)
        for name, grad in zip(joint.grad_names, grads):
            self._master_of(trainable[name]).grad = grad
        if overflow and drop_on_overflow:
            with torch.no_grad():
                for tensor, saved in zip(mutated, before):
                    tensor.copy_(saved)
            outcome = Overflow.SKIPPED
        else:
            self.optimizer.step()
            outcome = Overflow.APPLIED if overflow else Overflow.NONE
        self._scaling.update_loss_scale(overflow)
        self.last_note = self.history.record(outcome, scale, float(self._scaling.get_loss_scale()))
        if self._bad_steps is not None:
            self._bad_steps.record(overflow, skipped=outcome is Overflow.SKIPPED, loss_scale=scale)
        return loss, outcome, scale

    def report(self) -> str:
        """The steps so far: applied, skipped (and how many of those were the scale calibrating itself)."""
        eager = [joint.graph_module.reason for joint in self._graphs.values()
                 if isinstance(joint.graph_module, EagerStep)]
        return self.history.summary() + (f"\nsteps run eagerly: {eager[0]}" if eager else "")

    def clear_traced_graphs(self) -> None:
        """Forget every traced graph; the next call traces again (e.g. after changing Dropout.p)."""
        self._graphs.clear()
        self._last = None

    def _split(self, args: tuple) -> tuple[tuple, object]:
        if len(args) < self._required_inputs + 1:
            raise TypeError(
                f"step(*inputs, label): the model takes {self._required_inputs} input(s) and the label comes "
                f"last, but the step got {len(args)} argument(s): the label is missing")
        if len(args) > self._max_inputs + 1:
            raise TypeError(f"step(*inputs, label): the model takes at most {self._max_inputs} input(s) plus "
                            f"the label, got {len(args)} arguments")
        return tuple(args[:-1]), args[-1]

    def _trainable(self) -> dict[str, nn.Parameter]:
        in_optimizer = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        masters = ((name, p, self._master_of(p)) for name, p in self._named_parameters)
        return {name: p for name, p, master in masters if id(master) in in_optimizer and master.requires_grad}

    def _state(self, trainable: dict) -> dict[str, torch.Tensor]:
        frozen = {name: p for name, p in self._named_parameters if name not in trainable}
        return {**frozen, **dict(self._named_buffers)}

    def _joint_graph(self, inputs: tuple, label, trainable: dict) -> JointGraph:
        for model_module, graph_module in self._flag_pairs:
            graph_module.training = model_module.training
        key = (_signature((inputs, label)), tuple(g.training for _, g in self._flag_pairs), tuple(trainable))
        joint = self._graphs.get(key)
        if joint is None:
            joint = self._traced_or_eager(inputs, label, trainable)
            self.num_traces += 1
            self._graphs[key] = joint
            if len(self._graphs) > MAX_CACHED_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self._last = joint
        return joint


    def _traced_or_eager(self, inputs: tuple, label, trainable: dict) -> JointGraph:
        """The joint graph; a forward whose Python reads tensor values (a top level convert() runs as written,
        PyG's pooling without a size) cannot be traced with fake tensors: the same step, eagerly."""
        state = self._state(trainable)
        try:
            with self.low_weights.paused() if self.low_weights is not None else contextlib.nullcontext():
                return trace_joint_graph(self.converted, self.loss_fn, trainable, state, inputs, label)
        except DATA_DEPENDENT as error:
            reason = (f"{type(self.converted).__name__}'s forward reads tensor values in Python, which fake tensors "
                      f"cannot trace ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]})")
            self.last_note = f"steps run eagerly: {reason}"
            return eager_step(self.converted, self.loss_fn, trainable, state, inputs, label, reason)


def build_train_network(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, level: str = "O2",
                        dtype: torch.dtype = torch.float16, loss_scale_manager=None, example_inputs=None,
                        store_weights_low: bool | None = None, **overrides) -> TrainStep:
    """Convert `model` at `level` and return the training step; `overrides` are convert()'s options.

    store_weights_low (default: True at O2 and O3): the weights only low ops read are held low between steps
    and remade from the fp32 masters (the model's parameters, which the optimizer steps) after each applied
    step, so no forward casts a weight (train/low_weights.py).

    Loss-scale defaults: O2 scales fp16 dynamically from 2**16 (the seeds' manager starts at 2**24, which
    only skips more first steps), bf16 at scale 1; O0, O1 and O3 do not scale unless `loss_scale_manager`
    is given. Whatever the manager, a step with inf/nan gradients is skipped unless it says
    drop_overflow_update=False.
    """
    check_train_arguments(model, optimizer, loss_fn)
    config = make_config(level, dtype=dtype, **overrides)
    if loss_scale_manager is None:
        loss_scale_manager = default_loss_scale_manager(config.level, config.low_dtype)
    check_loss_scale_manager(loss_scale_manager)
    converted = convert(model, level, example_inputs=example_inputs, dtype=dtype,
                        loss_scale_manager=loss_scale_manager, **overrides)
    if store_weights_low is None:
        store_weights_low = config.level_spec.stores_weights_low
    weights = LowWeights(converted, optimizer, config.low_dtype) if store_weights_low else None
    return TrainStep(model, converted, optimizer, loss_fn, loss_scale_manager, weights)


def _synchronise(grads: list[torch.Tensor], found_inf: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """Average the gradients over the process group and OR the overflow flags, in one all-reduce."""
    if not (dist.is_available() and dist.is_initialized()):
        return grads, bool(found_inf)
    flat = torch.cat([g.reshape(-1) for g in grads] + [found_inf.to(torch.float32).reshape(1)])
    dist.all_reduce(flat)
    overflow = bool(flat[-1] > 0)
    flat = flat[:-1].div_(dist.get_world_size())
    averaged, offset = [], 0
    for grad in grads:
        averaged.append(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return averaged, overflow


def _training_flag_pairs(model: nn.Module, converted: fx.GraphModule) -> list[tuple[nn.Module, nn.Module]]:
    """(model's module, converted module) pairs; modules the converter added follow the model's root."""
    model_modules = dict(model.named_modules())
    return [(model_modules.get(name, model), module) for name, module in converted.named_modules()]


def _input_arity(converted: nn.Module) -> tuple[int, int]:
    if not isinstance(converted, fx.GraphModule):   # convert() ran the model as written, children converted
        return _signature_arity(converted)
    placeholders = [n for n in converted.graph.nodes if n.op == "placeholder"]
    required = sum(1 for n in placeholders if not n.args and not n.target.startswith("*"))
    if any(n.target.startswith("*") for n in placeholders):
        return required, 10 ** 6
    return required, len(placeholders)


def _signature_arity(module: nn.Module) -> tuple[int, int]:
    parameters = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return sum(1 for p in parameters if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD), 10 ** 6
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(1 for p in positional if p.default is p.empty), len(positional)


def _signature(tree) -> tuple:
    """What the traced graph is specialised to: tensor shapes/strides/dtypes/devices, other values as such."""
    parts = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
        elif isinstance(leaf, Hashable):
            parts.append((type(leaf), leaf))
        else:
            raise TypeError(f"non-tensor inputs are baked into the traced step and must be hashable, got "
                            f"{type(leaf).__name__}")
    return tuple(parts)
