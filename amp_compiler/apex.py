"""Apex's amp API (`from apex import amp`) on this project's compiler: a migration that changes one import.

    model, optimizer = amp_compiler.initialize(model, optimizer, opt_level="O2")   # in place, as Apex
    with amp_compiler.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

The levels are Apex's: O0 fp32 as written; O1 the op policy (convert(model, "O1", inplace=True)); O2 the
model's weights low (norms fp32 with keep_batchnorm_fp32) and fp32 master weights in the optimizer's param
groups: after backward the low gradients are unscaled into the masters' .grad, after step the masters are
copied back into the model (the pairs, the fold and the copy are train/low_weights.py's MasterWeights, which
low_weights() is built on too); O3 everything low. Each model is converted in place first, so its graphs cast
inputs and outputs at their boundaries (what Apex's patched forward did); O2/O3 then cast the weights, which
turns the graphs' weight casts into no-ops. Loss scaling reuses the loss-scale managers (train/loss_scale.py),
one per loss (num_losses): an overflow halves the scale and the next optimizer.step() is skipped, as Apex's.
The state (options, scalers, masters) is one AmpState per initialize() (Apex's `_amp_state` is module-global):
each optimizer reaches its own through its stash, so two initialize() calls in one process do not meet. Apex's
argument-less amp.state_dict()/load_state_dict() address the latest initialize's, as Apex's do (optimizer= names
another).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
import warnings
from collections import OrderedDict

import torch
from torch import nn

from amp_compiler.convert_model import convert
from amp_compiler.converted import compiled_record
from amp_compiler.train.low_weights import MasterPair, MasterWeights, unscale_
from amp_compiler.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from amp_compiler.train.scale_arguments import checked_scale

LOW = (torch.float16, torch.bfloat16)
# kept fp32 at O2 with keep_batchnorm_fp32 (Apex keeps batch norms only; the graphs run these as mixed kernels)
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
APEX_INIT_SCALE = 2.0 ** 16     # Apex's LossScaler starts here (min with max_loss_scale)
APEX_MAX_SCALE = 2.0 ** 24


@dataclasses.dataclass(frozen=True)
class Properties:
    """One level's options after the user's overrides (Apex's `Properties`)."""
    opt_level: str
    low_dtype: torch.dtype            # the compiler's low dtype (O1's op policy, O2/O3's weights)
    cast_weights: bool                # O2/O3: the model's weights are cast to low_dtype
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: float | str           # a number or "dynamic"
    loss_scale_given: bool            # the user chose it (bf16's default is scale 1 otherwise)


# Apex's defaults per level: cast the weights, keep_batchnorm_fp32, master_weights, loss_scale.
LEVEL_DEFAULTS = {"O0": (False, None, False, 1.0), "O1": (False, None, False, "dynamic"),
                  "O2": (True, True, True, "dynamic"), "O3": (True, False, False, 1.0)}


@dataclasses.dataclass(eq=False)
class AmpState:
    """One initialize()'s state: its options, one loss scaler per loss, its optimizers' stashes (their masters)."""
    properties: Properties | None
    scalers: list = dataclasses.field(default_factory=list)    # LossScaleManager per loss_id
    verbosity: int = 1
    stashes: list = dataclasses.field(default_factory=list)    # OptimizerStash per optimizer

    @property
    def enabled(self) -> bool:
        return self.properties is not None

    def say(self, message: str) -> None:
        if self.verbosity > 0:
            print(f"amp_compiler: {message}")

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of a low model parameter, held by any of this initialize's optimizers; else None."""
        for stash in self.stashes:
            if (pair := stash.masters.pair_of(param)) is not None:
                return pair.master
        return None


# The latest initialize()'s state, only for what names no optimizer: Apex's amp.state_dict() and
# load_state_dict() (and a scale_loss given none). Everything else goes through the optimizer's own stash.
_latest: AmpState | None = None


# -- initialize ------------------------------------------------------------------------------------------
def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None,
               max_loss_scale=APEX_MAX_SCALE, capture=None):
    """Apex's amp.initialize: convert the model(s) in place and prepare the optimizer(s) for `opt_level`.

    Returns the same objects, as Apex: lists where lists were given. Call it once, after building the models
    and optimizers and before wrapping them in DistributedDataParallel. `capture` (not Apex's): convert()'s,
    TorchDynamo's, the only one (O2/O3's stored low weights are what its graphs read).
    """
    global _latest
    if not enabled:   # the optimizers are marked only: scale_loss yields their losses as they are
        _latest = AmpState(None, verbosity=verbosity)
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            if isinstance(optimizer, torch.optim.Optimizer) and not _initialized_already(optimizer):
                optimizer._amp_stash = OptimizerStash(_latest)
        return models if optimizers is None else (models, optimizers)
    properties = resolve_properties(opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
                                    master_weights, loss_scale, cast_model_outputs)
    model_list, optimizer_list = _as_list(models, nn.Module, "models"), _optimizer_list(optimizers)
    _check_fresh(model_list, optimizer_list)   # before anything changes
    state = AmpState(properties, verbosity=verbosity)
    state.scalers = [_loss_scaler(properties, min_loss_scale, max_loss_scale) for _ in range(_count(num_losses))]
    _convert_and_prepare(model_list, optimizer_list, state, capture)
    _latest = state
    state.say(f"initialize: {_summary(properties, state.scalers[0])}")
    return _returned(models, model_list, optimizers, optimizer_list)


def resolve_properties(opt_level, cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
                       master_weights=None, loss_scale=None, cast_model_outputs=None) -> Properties:
    """The level's Apex defaults with the user's overrides, each checked with a message naming the fix."""
    if opt_level not in LEVEL_DEFAULTS:
        raise ValueError(f"opt_level must be one of {', '.join(LEVEL_DEFAULTS)} (the letter O, not zero), "
                         f"got {opt_level!r}")
    cast_weights, keep_norms, masters, scale = LEVEL_DEFAULTS[opt_level]
    low = torch.float16
    if cast_model_type is not None:
        cast_weights, low = _cast_model_type(opt_level, cast_model_type, cast_weights)
    if patch_torch_functions not in (None, opt_level == "O1"):
        raise ValueError(f"patch_torch_functions={patch_torch_functions!r} at {opt_level}: here the op policy "
                         "is a level, not a switch: use opt_level='O1' for it, O0/O2/O3 without it")
    if cast_model_outputs not in (None, torch.float32):
        raise ValueError(f"cast_model_outputs={cast_model_outputs!r}: converted models return float32 outputs "
                         "where the model as written does (keep_io_types); cast the outputs yourself")
    if keep_batchnorm_fp32 is not None:
        keep_norms = _boolean(keep_batchnorm_fp32, "keep_batchnorm_fp32")
    if master_weights is not None:
        masters = _boolean(master_weights, "master_weights")
    given = loss_scale is not None
    if given:
        scale = _loss_scale(loss_scale)
    return Properties(opt_level, low, cast_weights, keep_norms, masters and cast_weights, scale, given)


def _cast_model_type(opt_level: str, value, default: bool) -> tuple[bool, torch.dtype]:
    """(cast the weights?, low dtype). False or float32: weights stay as they are; at O1 a low dtype picks
    the op policy's dtype (Apex refuses it there: its O1 is fp16 only)."""
    if value is False or value == torch.float32:
        return False, torch.float16
    if value not in LOW:
        raise ValueError(f"cast_model_type must be torch.float16, torch.bfloat16, torch.float32 or False, got "
                         f"{value!r}")
    if opt_level == "O0":
        raise ValueError(f"cast_model_type={value} at O0: O0 trains in fp32; use opt_level='O1' (op policy), "
                         "'O2' (low weights, fp32 masters) or 'O3' (everything low)")
    return default, value


def _boolean(value, name: str) -> bool:
    if value in (True, False, "True", "False"):
        return value in (True, "True")
    raise ValueError(f"{name} must be True, False, 'True' or 'False', got {value!r}")


def _loss_scale(value) -> float | str:
    if value == "dynamic":
        return "dynamic"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be a number, a number as a string ('128.0') or 'dynamic', "
                         f"got {value!r}") from None
    return checked_scale(number, "loss_scale")


def _count(num_losses) -> int:
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive integer (one loss scaler per loss), got {num_losses!r}")
    return num_losses


class ApexDynamicLossScale(DynamicLossScaleManager):
    """Apex's dynamic rule on the project's manager: starts at min(2**16, max_loss_scale), halves on overflow
    (not below min_loss_scale, nor 1), doubles after 2000 clean steps (not above max_loss_scale)."""

    def __init__(self, min_loss_scale=None, max_loss_scale=APEX_MAX_SCALE) -> None:
        self.max_loss_scale = checked_scale(max_loss_scale, "max_loss_scale")
        self.min_loss_scale = 1.0 if min_loss_scale is None else checked_scale(min_loss_scale, "min_loss_scale")
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(f"min_loss_scale ({min_loss_scale}) is above max_loss_scale ({max_loss_scale})")
        super().__init__(init_loss_scale=min(APEX_INIT_SCALE, self.max_loss_scale), scale_factor=2,
                         scale_window=2000)

    def _follow_rule(self, overflow: bool) -> None:
        super()._follow_rule(overflow)
        self.loss_scale = min(max(self.loss_scale, self.min_loss_scale), self.max_loss_scale)


def _loss_scaler(properties: Properties, min_loss_scale, max_loss_scale) -> LossScaleManager:
    if properties.loss_scale != "dynamic":   # Apex's static scale applies an overflowing step anyway
        return FixedLossScaleManager(properties.loss_scale, drop_overflow_update=False)
    if properties.low_dtype == torch.bfloat16 and not properties.loss_scale_given:
        return FixedLossScaleManager(1.0, drop_overflow_update=True)   # bf16 has fp32's range: no scale needed
    return ApexDynamicLossScale(min_loss_scale, max_loss_scale)


def _as_list(value, kind: type, name: str) -> list:
    values = value if isinstance(value, list) else [value]
    wrong = [type(v).__name__ for v in values if not isinstance(v, kind)]
    if wrong:
        raise TypeError(f"{name} must be a {kind.__name__} or a list of them, got {', '.join(wrong)}")
    return values


def _optimizer_list(optimizers) -> list:
    return [] if optimizers is None else _as_list(optimizers, torch.optim.Optimizer, "optimizers")


def _returned(models, model_list, optimizers, optimizer_list):
    """Apex's shapes: a list back where a list came in; the models alone without optimizers."""
    models_back = model_list if isinstance(models, list) else model_list[0]
    if optimizers is None:
        return models_back
    return models_back, optimizer_list if isinstance(optimizers, list) else optimizer_list[0]


def _initialized_already(optimizer: torch.optim.Optimizer) -> bool:
    stash = getattr(optimizer, "_amp_stash", None)
    return stash is not None and stash.amp.enabled   # initialize(enabled=False) changed nothing


def _check_fresh(models: list, optimizers: list) -> None:
    again = any(_initialized_already(optimizer) for optimizer in optimizers) or any(
        compiled_record(model) is not None for model in models)
    if again:   # before the dtype check: its advice (model.float()) would leave the first masters stale
        raise RuntimeError("a model or optimizer went through amp_compiler.initialize already: call initialize "
                           "once, with every model and optimizer (lists)")
    for model in models:
        low = sorted({str(p.dtype) for p in model.parameters() if p.dtype in LOW})
        if low:   # Apex's check_params_fp32: the masters must start from fp32 weights
            raise ValueError(f"{type(model).__name__} has {', '.join(low)} parameters: initialize() starts from "
                             "an fp32 model (O2/O3 cast the weights themselves). Call model.float() first.")


def _convert_and_prepare(models: list, optimizers: list, state: AmpState, capture: str | None = None) -> None:
    """Convert the models in place, give the optimizers fp32 masters of the weights O2 casts (state.stashes),
    cast them; the models' checkpoint hooks read the masters through `state`."""
    properties = state.properties
    to_cast = [p for model in models for p in _weights_to_cast(model, properties)]
    for model in models:
        _convert(model, properties, capture)
    # the masters start from the fp32 weights themselves (Apex's from their fp16 rounding); one no optimizer
    # holds is dropped (add_param_group later starts one from the low weight)
    candidates = {p: p.detach().clone() for p in to_cast
                  if isinstance(p, nn.Parameter) and p.requires_grad and properties.master_weights}
    for optimizer in optimizers:
        state.stashes.append(_prepare_optimizer(optimizer, state, candidates))
    _cast(to_cast, properties.low_dtype)
    if properties.cast_weights:
        for model in models:
            _checkpoint_in_fp32(model, state)


def _convert(model: nn.Module, properties: Properties, capture: str | None = None) -> None:
    if properties.opt_level == "O0":
        return   # fp32 as written
    keep_norms = properties.keep_batchnorm_fp32
    overrides = {} if keep_norms is None else {"keep_batchnorm_fp32": keep_norms}
    convert(model, properties.opt_level, inplace=True, dtype=properties.low_dtype, capture=capture, **overrides)
    if properties.cast_weights:
        # the graphs are captured on calls, after _cast: they read the low weights as the model holds
        # them, so the model's code meets its inputs in the weights' dtype, as Apex's patched forward casts them
        # (`x * self.scale` then a conv: an fp32 input and low weights fail in dynamo's trace as in eager)
        state = compiled_record(model)
        for forward in (state, *(compiled_record(model.get_submodule(path)) for path in state.nested)):
            forward.weights_cast_low = True   # on purpose: no "call model.float()" warning
        compiled_record(model).undo = (   # amp_compiler.restore(model) removes them
            model.register_forward_pre_hook(_InputsCast(properties.low_dtype), with_kwargs=True),
            model.register_forward_hook(_outputs_fp32))   # low outputs back fp32, as cast_model_outputs


def _weights_to_cast(model: nn.Module, properties: Properties) -> list[torch.Tensor]:
    """O2/O3's low tensors: every floating parameter, but the norms' at O2 with keep_batchnorm_fp32; a low
    norm's running statistics too (torch's batch norm wants them in its weights' dtype). Other buffers stay:
    the graphs cast them where the op policy says."""
    if not properties.cast_weights:
        return []
    keep_norms = bool(properties.keep_batchnorm_fp32)
    tensors = {}
    for module in model.modules():
        if keep_norms and isinstance(module, NORMS):
            continue
        buffers = module.buffers(recurse=False) if isinstance(module, NORMS) else ()
        for tensor in (*module.parameters(recurse=False), *buffers):
            if tensor.is_floating_point():
                tensors[id(tensor)] = tensor   # a parameter shared by two modules is cast once
    return list(tensors.values())


class _InputsCast:
    """A forward pre-hook: the call's floating tensors cast to `dtype` (Apex O2/O3's input cast); picklable."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        def cast(value):
            return value.to(self.dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        return torch.utils._pytree.tree_map(cast, (args, kwargs))


def _outputs_fp32(module, args, output):
    """A forward hook: low floating outputs back to fp32 (a tensor, a tuple or list of them, a dict or ModelOutput's
    tensor values; a KV cache object is left as it is)."""
    def fp32(value):
        low = isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)
        return value.float() if low else value
    if isinstance(output, tuple) and hasattr(output, "_fields"):   # a namedtuple takes its fields positionally
        return type(output)(*map(fp32, output))
    if isinstance(output, (tuple, list)):
        return type(output)(fp32(value) for value in output)
    if isinstance(output, dict):
        for key, value in list(output.items()):
            output[key] = fp32(value)
        return output
    return fp32(output)


def _cast(tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
    # .data on the model's own Parameter objects: the in-place graphs and the user's references see the cast
    for tensor in tensors:
        tensor.data = tensor.data.to(dtype)


def _summary(properties: Properties, scaler: LossScaleManager) -> str:
    weights = f"weights {properties.low_dtype}" if properties.cast_weights else "weights as they are"
    if properties.cast_weights and properties.keep_batchnorm_fp32:
        weights += " (norms fp32)"
    masters = ", fp32 master weights" if properties.master_weights else ""
    return f"opt_level {properties.opt_level}: {weights}{masters}, loss scale {scaler!r}"


# -- the optimizer ------------------------------------------------------------------------------------------
class OptimizerStash:
    """What initialize adds to an optimizer (`optimizer._amp_stash`, Apex's name): its initialize's AmpState;
    the O2 pairs (`masters`, low_weights.MasterWeights: the model's own parameters cast low, the fp32 masters the
    param groups hold), folded on leaving scale_loss and copied back by a step post-hook; the parameters it steps
    itself; and Apex's step/zero_grad/add_param_group wrappers (wrap/unwrap)."""

    def __init__(self, amp: AmpState) -> None:
        self.amp = amp
        self.masters = MasterWeights()
        self.own: list = []                # parameters the optimizer steps themselves
        self.stashed: list = []            # their gradients from before this backward
        self.skip_next_step = False        # scale_loss found inf/nan: the next step() does nothing
        self.scaled_grads_pending = False  # a delay_unscale backward left scaled gradients
        self._undo: list = []              # (optimizer, name, what it held before wrap()), for unwrap()
        self._copy_hook = None             # wrap()'s step post-hook: the masters copied into the model

    @property
    def pairs(self) -> list[MasterPair]:
        return self.masters.pairs

    def adopt(self, params, candidates: dict | None = None) -> list:
        """The params a param group holds: an fp32 master for each low one (at O2), else the param itself. The
        master is the candidate (initialize's fp32 clone of the weight), a master another optimizer of this
        initialize holds already, or a new one from the low parameter (add_param_group's)."""
        adopted = []
        for param in params:
            master = candidates.get(param) if candidates else None
            if master is None:
                master = self.amp.master_of(param)
            will_be_low = master is not None or param.dtype in LOW
            if self.amp.properties.master_weights and param.requires_grad and will_be_low:
                if master is None:   # a low parameter from add_param_group: its master starts from it
                    master = param.detach().float()
                master.requires_grad_(True)
                self.masters.add_pair(MasterPair(low=param, master=master))
                adopted.append(master)
            else:
                self.own.append(param)
                adopted.append(param)
        return adopted

    def before_backward(self) -> None:
        """Gradients from earlier backwards are unscaled already: set them aside, added back after."""
        for pair in self.pairs:
            pair.low.grad = None
        self.stashed = [param.grad for param in self.own]
        for param in self.own:
            param.grad = None

    def after_backward(self, inv_scale: float) -> bool:
        """Unscale this backward's gradients into the masters (the own parameters' into themselves), add the
        earlier ones; True when any of this backward's is inf/nan. The model's low parameters keep theirs."""
        _, found = self.masters.fold(inv_scale, clear_low=False)
        new = []
        stashed = self.stashed or [None] * len(self.own)
        for param, before in zip(self.own, stashed):
            if param.grad is None:
                param.grad = before
            else:
                new.append((param, param.grad.float(), before))
        self.stashed = []
        found = unscale_([grad for _, grad, _ in new], inv_scale) or found
        for target, grad, before in new:
            total = grad if before is None else grad + before
            target.grad = total.to(target.dtype)
        return found

    def backward_outside_scale_loss(self) -> bool:
        """The model's low parameters have gradients and no master has one: a loss.backward() without
        scale_loss, whose gradients the masters never see."""
        return any(pair.low.grad is not None for pair in self.pairs) and \
            all(pair.master.grad is None for pair in self.pairs)

    def clear_master_grads(self) -> None:
        # model.zero_grad() cannot reach them (Apex clears them after each step too)
        for pair in self.pairs:
            pair.master.grad = None

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Apex's optimizer.step, zero_grad and add_param_group, as instance attributes (the class untouched;
        bound methods, so an LR scheduler created later can wrap step()); unwrap() puts the optimizer's own back.

        A wrapped step, as Apex patches it: a step whose gradients scale_loss found inf/nan in must not run at
        all, and a step pre-hook cannot skip one (it may only change the arguments); zero_grad must clear the
        model's low parameters, which no param group holds, and add_param_group give new low parameters masters:
        torch has no hook for either. The copy master -> model after a real step is a step post-hook
        (MasterWeights.copy_after_steps), the one low_weights() uses."""
        step, zero_grad, add_param_group = optimizer.step, optimizer.zero_grad, optimizer.add_param_group
        stash = self

        def amp_step(self, closure=None):
            if closure is not None:
                raise RuntimeError("optimizer.step(closure) is not supported after initialize (nor by Apex): the "
                                   "closure would recompute gradients outside scale_loss; call backward in "
                                   "scale_loss, then step()")
            if stash.skip_next_step:   # scale_loss found inf/nan in this step's gradients
                stash.skip_next_step = False
                stash.clear_master_grads()
                return None
            if stash.backward_outside_scale_loss():
                raise RuntimeError("optimizer.step() found gradients on the model's low weights but none on the "
                                   "fp32 master weights it steps: backward ran outside amp_compiler.scale_loss. "
                                   "Use `with amp_compiler.scale_loss(loss, optimizer) as scaled: "
                                   "scaled.backward()`")
            result = step()   # its post-hook copies the masters into the model
            stash.clear_master_grads()
            return result

        def amp_zero_grad(self, set_to_none: bool = True):
            zero_grad(set_to_none=set_to_none)
            for pair in stash.pairs:   # the model's low parameters are not in the param groups
                pair.low.grad = None

        def amp_add_param_group(self, param_group: dict):
            params = param_group["params"]
            if isinstance(params, set):
                raise TypeError("add_param_group: give the parameters as a list (a set's order changes between "
                                "runs)")
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            add_param_group({**param_group, "params": stash.adopt(params)})

        if hasattr(step, "_wrapped_by_lr_sched"):   # a scheduler built before initialize: amp_step still calls it
            amp_step._wrapped_by_lr_sched = True
        for name, method in (("step", amp_step), ("zero_grad", amp_zero_grad),
                             ("add_param_group", amp_add_param_group)):
            self._undo.append((optimizer, name, optimizer.__dict__.get(name, _ABSENT)))   # an earlier wrapper's
            setattr(optimizer, name, types.MethodType(method, optimizer))
        self._copy_hook = self.masters.copy_after_steps(optimizer)

    def unwrap(self) -> None:
        """The optimizer's own step, zero_grad and add_param_group back (or the wrappers it had before wrap()),
        the copy hook removed: no step is skipped nor copied into the model any more. Its param groups keep the
        masters."""
        for optimizer, name, before in reversed(self._undo):
            if before is _ABSENT:
                optimizer.__dict__.pop(name, None)
            else:
                setattr(optimizer, name, before)
        self._undo = []
        if self._copy_hook is not None:
            self._copy_hook.remove()
            self._copy_hook = None


_ABSENT = object()   # wrap(): the optimizer had no instance attribute of that name (the class's method)


def _prepare_optimizer(optimizer: torch.optim.Optimizer, state: AmpState, candidates: dict) -> OptimizerStash:
    stash = optimizer._amp_stash = OptimizerStash(state)
    for group in optimizer.param_groups:
        holds = list(group["params"])
        group["params"] = stash.adopt(holds, candidates)
        for before, now in zip(holds, group["params"]):
            if before is not now and before in optimizer.state:   # momentum etc. move to the master
                optimizer.state[now] = optimizer.state.pop(before)
    stash.wrap(optimizer)
    return stash


# -- the model's checkpoints --------------------------------------------------------------------------------
def _checkpoint_in_fp32(model: nn.Module, state: AmpState) -> None:
    """model.state_dict() holds fp32 weights (the masters' values where there are masters; Apex's
    O2StateDictHook saves the fp16 weights cast up), and load_state_dict() sets the masters too, so a
    checkpoint restores training exactly; a Hugging Face model's save_pretrained records float32 in its config."""
    def fp32_values(module, state_dict, prefix, local_metadata):
        for stash in state.stashes:
            stash.masters.masters_in_state_dict(module, state_dict, prefix)
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.dtype in LOW:
                state_dict[key] = value.float()

    def load_masters(module, state_dict, prefix, *rest):
        for stash in state.stashes:
            stash.masters.load_into_masters(module, state_dict, prefix)

    model.register_state_dict_post_hook(fp32_values)
    model.register_load_state_dict_pre_hook(load_masters)
    if callable(getattr(model, "save_pretrained", None)) and hasattr(getattr(model, "config", None), "save_pretrained"):
        model.__dict__["save_pretrained"] = types.MethodType(save_pretrained, model)


def save_pretrained(self, save_directory, *args, **kwargs):
    """A Hugging Face model's save_pretrained after O2/O3 cast its weights: the weights file holds fp32 (the
    masters, by the state_dict hook above), but transformers writes config.json's "dtype" from the first
    parameter (float16), and a plain from_pretrained (dtype="auto") would round the fp32 weights to it. The
    config is written again recording float32, the dtype of what was saved (not for a state_dict= of the
    caller's, whose dtypes are its own; push_to_hub=True uploads before this rewrite)."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    given = inspect.signature(type(self).save_pretrained).bind_partial(self, save_directory, *args, **kwargs).arguments
    if given.get("state_dict") is None and given.get("is_main_process", True):
        self.config.dtype = "float32"
        self.config.save_pretrained(save_directory)
    return result


# -- scale_loss, master_params, state_dict --------------------------------------------------------------------
def _not_initialized() -> RuntimeError:
    return RuntimeError("amp_compiler.initialize() has not been called: call model, optimizer = "
                        "amp_compiler.initialize(model, optimizer, opt_level=...) before scale_loss/state_dict")


def _state_of(optimizer=None) -> AmpState:
    """`optimizer`'s initialize's state; given None, the latest initialize's (Apex's argument-less functions)."""
    if optimizer is not None:
        return _stash_of(optimizer).amp
    if _latest is None:
        raise _not_initialized()
    return _latest


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Apex's amp.scale_loss: yields `loss.float() * scale`; on exit the gradients are unscaled (into the fp32
    masters at O2) and checked: inf/nan halves the scale (dynamic) and skips the next optimizer.step().

    delay_unscale=True leaves this backward's gradients scaled for a later scale_loss to unscale (Apex's
    gradient accumulation shortcut); `model` is unused, as in Apex.
    """
    stashes = [_stash_of(optimizer) for optimizer in _optimizer_list(optimizers)]
    states = list({id(stash.amp): stash.amp for stash in stashes}.values())
    if len(states) > 1:
        raise ValueError("scale_loss got optimizers of different initialize() calls, whose loss scalers differ: "
                         "call scale_loss once per initialize's optimizers, or initialize them together (lists)")
    state = states[0] if states else _state_of()
    if not state.enabled:
        yield loss
        return
    scaler = _scaler(state, loss_id)
    scale = scaler.get_loss_scale()
    if scale == 1 and not scaler.get_drop_overflow_update() and not any(s.pairs for s in stashes):
        yield loss.float()   # Apex: static scale 1 and no masters, nothing to unscale or check
        return
    for stash in stashes:
        if not stash.scaled_grads_pending:
            stash.before_backward()
    yield loss.float() * scale
    if delay_unscale:
        for stash in stashes:
            stash.scaled_grads_pending = True
        return
    overflow = False
    for stash in stashes:
        overflow = stash.after_backward(1.0 / scale) or overflow
        stash.scaled_grads_pending = False
    if not delay_overflow_check:
        _update(state, scaler, loss_id, overflow, stashes)


def _stash_of(optimizer) -> OptimizerStash:
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None and _latest is None:
        raise _not_initialized()
    if stash is None and not _latest.enabled:   # Apex: after initialize(enabled=False), any optimizer's loss as is
        return OptimizerStash(_latest)
    if stash is None:
        raise RuntimeError(f"scale_loss got a {type(optimizer).__name__} that did not go through "
                           "amp_compiler.initialize: pass every optimizer to initialize (a list for several)")
    return stash


def _scaler(state: AmpState, loss_id) -> LossScaleManager:
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(state.scalers):
        raise ValueError(f"loss_id must be an integer from 0 to num_losses - 1 = {len(state.scalers) - 1}, got "
                         f"{loss_id!r}: give initialize(num_losses=...) one scaler per loss")
    return state.scalers[loss_id]


def _update(state: AmpState, scaler: LossScaleManager, loss_id: int, overflow: bool, stashes: list) -> None:
    scaler.update_loss_scale(overflow)
    if overflow and scaler.get_drop_overflow_update():
        for stash in stashes:
            stash.skip_next_step = True
        state.say(f"gradient overflow, skipping the step; loss scaler {loss_id} reduces the loss scale to "
                  f"{scaler.get_loss_scale():g}")


def master_params(optimizer: torch.optim.Optimizer):
    """The parameters the optimizer steps: the fp32 masters at O2, the model's own parameters otherwise."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None, *, optimizer=None) -> dict:
    """The loss scalers, in Apex's format: {"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}: the
    latest initialize's, as Apex's, or those of the initialize that prepared `optimizer`."""
    destination = OrderedDict() if destination is None else destination
    for index, scaler in enumerate(_state_of(optimizer).scalers):
        destination[f"loss_scaler{index}"] = {"loss_scale": scaler.get_loss_scale(),
                                              "unskipped": getattr(scaler, "clean_steps", 0)}
    return destination


def load_state_dict(state_dict: dict, *, optimizer=None) -> None:
    """Restore state_dict() (Apex's format): each loss scaler's scale and its clean-step count (into the latest
    initialize's scalers, as Apex, or those of the initialize that prepared `optimizer`)."""
    scalers = _state_of(optimizer).scalers
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:
        raise RuntimeError(f"amp state_dict has unexpected keys {unexpected}: give it what "
                           "amp_compiler.state_dict() (or Apex's amp.state_dict()) returned")
    if len(state_dict) != len(scalers):
        warnings.warn(f"the amp state_dict holds {len(state_dict)} loss scalers and initialize(num_losses=...) "
                      f"made {len(scalers)}: the first {min(len(state_dict), len(scalers))} are restored",
                      RuntimeWarning, stacklevel=2)
    for scaler, saved in zip(scalers, state_dict.values()):
        scaler.set_loss_scale(saved["loss_scale"])
        if hasattr(scaler, "clean_steps"):
            scaler.clean_steps = int(saved["unskipped"])
