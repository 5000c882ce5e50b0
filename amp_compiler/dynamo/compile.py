"""amp_compiler.compile(model, level): mixed precision on torch.compile's capture, the user's model kept.

The compilation is the model's instance `forward`: a CompiledForward that keeps the forward's signature, is hidden
from an enclosing torch.compile, and is rebuilt (not shared) by copy.deepcopy and torch.save / torch.load: the copy
compiles itself on its own first call, reading its own weights.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_compiler.config import make_config, with_model_lists
from amp_compiler.converted import COMPILED_ATTRIBUTE, compiled_record
from amp_compiler.dynamo.bodies import trace_checkpoint_sequential
from amp_compiler.dynamo.calibration import GraphCalls, run_samples
from amp_compiler.dynamo.effects import undone_effects
from amp_compiler.dynamo.fp8_histories import Fp8HistoryStore
from amp_compiler.dynamo.report import compare_compiled, explain_compiled, verify_compiled
from amp_compiler.dynamo.backend import RECOMPILE_LIMIT, amp_backend, forget_graphs, graphs, level_autocast



def compile(model: nn.Module, level: str = "O1", *, backend: str = "inductor", dynamic=None,  # noqa: A001
            weight_cache: bool = True, calibration_data=None, **overrides) -> nn.Module:
    """Compile `model` in place with torch.compile, each captured graph converted by `level`'s rules first.

    It is what `model.compile(backend=...)` (nn.Module.compile) does: the same object comes back, with its class,
    `generate`, `save_pretrained` and state_dict; only its forward goes through dynamo (an instance attribute
    `forward` that keeps the signature; a later torch.compile(model) runs this compilation inside its own).
    backend="eager": the rewritten graphs run as fx code; "inductor": they are compiled by inductor in the same
    compilation. Options are convert()'s (dtype=torch.bfloat16, ...). Graphs are made on calls (graph breaks and
    recompiles are dynamo's); amp_compiler.dynamo.graphs(model) lists them, each one explain()-able.
    `weight_cache` (backend="eager"): inference calls reuse each weight's low copy while it is unchanged
    (dynamo/weight_cache.py); False casts every weight on every call, as autocast outside a region does.
    `calibration_data` (input tuples): run through the model now, no grad, buffers kept; each graph is calibrated
    on the tensors it received (dynamo/calibration.py), so values past the low dtype's range stay fp32.
    Undo with amp_compiler.restore(model); compiling again replaces the compilation.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp_compiler.compile takes an nn.Module; got {type(model).__name__} "
                        "(for a function, torch.compile(fn, backend=amp_compiler.dynamo.amp_backend(config)))")
    config = with_model_lists(make_config(level, **overrides), model)   # _keep_in_fp32_modules read once, here
    if COMPILED_ATTRIBUTE in model.__dict__:   # compiled before: this compilation replaces that one
        restore_compiled(model)
    calibration = GraphCalls() if calibration_data is not None else None
    options = {"backend": backend, "dynamic": dynamic, "weight_cache": weight_cache}
    forward = CompiledForward(model, config, model.__dict__.get("forward"), options, calibration)
    model.__dict__[COMPILED_ATTRIBUTE] = model.__dict__["forward"] = forward
    forward.nested = _compile_encoder(model, config, options, calibration)
    if forward.fp8_histories is not None:
        forward.fp8_histories.not_mine = forward.nested
    if calibration is not None:
        try:
            run_samples(model, calibration, calibration_data, undone_effects(model, history_stores(model)))
        except Exception:
            restore_compiled(model)   # a sample the model fails on: the model as it was
            raise
    return model


class CompiledForward:
    """The compiled call, as the model's instance forward. Hidden from an enclosing torch.compile: a user's own
    torch.compile(model) traces Module._call_impl and inlines nested compiled code with its own backend (every
    matmul ran fp32); it sees one call it does not trace, and this compilation runs inside it. Hooks run around
    it, as around any forward. A deepcopy or a pickle of the model gets a CompiledForward of its own (__reduce__)."""

    def __init__(self, model: nn.Module, config, own_forward, options: dict, calibration: GraphCalls | None = None):
        self.model, self.config, self.own_forward, self.options = model, config, own_forward, dict(options)
        self.calibration = calibration   # the calibration samples' graph calls (a copy's graphs read them too)
        self.low_from_the_start = _low_dtypes(model)   # a frozen bf16 base is no later .half()
        trace_checkpoint_sequential()   # its segments recomputed low, not as written (bodies.py)
        self.fp8_histories = _history_store(model, config)   # fp8 delayed: every graph's amax histories, shared
        self.converter = amp_backend(config, backend=options["backend"], model=model,
                                     weight_cache=options["weight_cache"], calibration=calibration,
                                     histories=self.fp8_histories)
        self.compiled = torch.compile(_frame_of_its_own(), backend=self.converter, dynamic=options["dynamic"])
        written = own_forward if own_forward is not None else types.MethodType(type(model).forward, model)
        functools.update_wrapper(self, written)   # inspect.signature(model.forward) stays the user's (generate reads it)

    _amp_installed_forward = True   # not the user's forward: a trace of the model (convert()) goes past it
    warned_dispatch_mode = False
    warned_low_parameters = False
    weights_cast_low = False          # Apex's O2/O3 made the weights low on purpose (no warning then)
    not_captured: str | None = None   # why dynamo made no graph of the model: it runs under autocast
    undo: tuple = ()   # hook handles removed by restore (an integration's: Apex O2's casts)
    nested: tuple = ()   # paths of submodules compiled with the model (an encoder-decoder's encoder)

    def __call__(self, *args, **kwargs):
        return _run(self, args, kwargs)

    runs_a_forward = True   # the model's forward is this record (CompiledChildren: its children's are)

    def graphs(self, model: nn.Module) -> list[tuple[str, object, CompiledForward]]:
        """(the module path, the graph, its CompiledForward) of every graph made so far, those of a submodule
        compiled with the model (its encoder) under its path."""
        return [("", gm, self) for gm in graphs(model)] + [
            (f"{path}.{inner}" if inner else path, gm, forward) for path, nested, record in _still_compiled(
                model, self.nested) for inner, gm, forward in record.graphs(nested)]

    def forwards(self, model: nn.Module) -> list[CompiledForward]:
        """This record and those of the submodules compiled with it."""
        return [self, *(forward for _, nested, record in _still_compiled(model, self.nested)
                        for forward in record.forwards(nested))]

    # The tools' entry points: a compiled model's graphs exist only once it is called, so it reports itself
    def explain(self, model: nn.Module):
        return explain_compiled(model, self)

    def verify(self, model: nn.Module, inputs: tuple, kwargs: dict) -> None:
        verify_compiled(model, inputs, kwargs)

    def compare(self, reference: nn.Module, model: nn.Module, inputs: tuple, rtol: float | None):
        return compare_compiled(reference, model, inputs, rtol)

    def __reduce__(self):   # copy.deepcopy / pickle: rebuilt for the copied model, graphs and caches not shared
        return CompiledForward, (self.model, self.config, self.own_forward, self.options, self.calibration), \
            {"nested": self.nested, "weights_cast_low": self.weights_cast_low,
             "low_from_the_start": self.low_from_the_start}


@torch._dynamo.disable
def _run(forward: CompiledForward, args: tuple, kwargs: dict):
    if _get_current_dispatch_mode() is not None or forward.not_captured is not None:
        return _under_autocast(forward, args, kwargs)
    sharded = None if forward.options.get("per_block") else \
        _sharded_submodule(forward.model, made_graphs=forward.converter.made_a_graph())
    if sharded is not None:
        return _sharded_call(forward, sharded, args, kwargs)
    if not forward.converter.made_a_graph():   # until a graph is made: did dynamo skip?
        return _first_calls(forward, args, kwargs)
    return _compiled_call(forward, args, kwargs)


def _sharded_submodule(model: nn.Module, made_graphs: bool) -> str | None:
    """A block of `model` FSDP2 shards. Until a graph is made, every module is looked at (0.5 ms on a 32-layer
    Llama); after, only whether the root is sharded too (as FSDP2's recipe does last), so a decode step pays 1 us."""
    if made_graphs:
        sharded_type = fsdp_module_type()
        if sharded_type is None or not isinstance(model, sharded_type):
            return None
    return fsdp_sharded_submodule(model)


def fsdp_module_type() -> type | None:
    """FSDP2's FSDPModule (what fully_shard makes a module), or None when torch.distributed.fsdp is not imported:
    then nothing can be sharded."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def fsdp_sharded_submodule(module: nn.Module) -> str | None:
    """The path of a module below `module` that FSDP2's fully_shard manages, if any."""
    sharded_type = fsdp_module_type()
    if sharded_type is None:
        return None
    return next((path for path, child in module.named_modules() if path and isinstance(child, sharded_type)), None)


def _sharded_call(forward: CompiledForward, sharded: str, args: tuple, kwargs: dict):
    """A model whose blocks FSDP2 shards (fully_shard per block, after converting, before or after its first calls):
    dynamo's graph of the whole model reads every weight at its start, before FSDP's per-block hooks gather them
    (measured: trained 20% off the one-process run, silently). So the model is compiled per block instead, as
    FSDP2's recipe compiles it: each sharded block, and each submodule with parameters and no sharded block in it,
    is compiled on its own (FSDP's unshard and reshard run around each block's compiled call); the modules above
    them run as written (glue: residual adds, the loop over the blocks). A model whose weights are already low
    (Apex O2/O3, model.half()) is refused, unchanged: its input casts belong to the whole-model compilation."""
    model = forward.model
    from amp_compiler.frontend.capture import low_parameter_dtypes
    if low_parameter_dtypes(model):
        raise ValueError(f"amp_compiler: {type(model).__name__}'s submodule {sharded} is sharded with FSDP2 "
                         "(fully_shard) and its weights are low already: convert the fp32 model (Apex's levels: "
                         "amp_compiler.initialize), then shard it")
    histories = forward.fp8_histories.tensors if forward.fp8_histories is not None else {}
    restore_compiled(model)
    compile_per_block(model, forward.config, forward.options,
                      note=f"compiled per block: its submodule {sharded} is sharded with FSDP2 (fully_shard)")
    hand_over_histories(histories, history_stores(model))
    return model.forward(*args, **kwargs)   # this call's hooks (FSDP's root ones) ran already: the forward alone


def hand_over_histories(tensors: dict, stores: list) -> None:
    """The whole model's fp8 amax histories (loaded before its first sharded call, or recorded before sharding)
    to the per-block store holding each one's module: else the blocks' graphs would start from empty histories."""
    for prefix, store in stores:
        for key in [k for k in tensors if k.startswith(prefix)]:
            store.tensors.setdefault(key[len(prefix):], tensors[key])


def compile_per_block(model: nn.Module, config, options: dict, note: str) -> nn.Module:
    """Each FSDP2-sharded block of `model` and each submodule with parameters and no sharded block below it
    compiled on its own with `config`; the modules that hold sharded blocks run as written (CompiledChildren)."""
    sharded_type = fsdp_module_type()
    paths = []

    def visit(module: nn.Module, path: str) -> None:
        holds_sharded = any(isinstance(m, sharded_type) for name, m in module.named_modules() if name)
        if not holds_sharded:
            if any(True for _ in module.parameters()):
                _compile_with(module, config, {**options, "per_block": True})
                paths.append(path)
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    model.__dict__[COMPILED_ATTRIBUTE] = CompiledChildren(config, paths, note=note)
    return model


def _compile_encoder(model: nn.Module, config, options: dict, calibration: GraphCalls | None) -> tuple:
    """An encoder-decoder's encoder compiled too: generate() calls model.get_encoder() itself, before the model's
    forward, so the encoder would run as written (fp32). Returns its path, () when the model has none. Only an
    encoder-decoder's: other transformers models have a get_encoder too (BERT's BertEncoder), which generate does
    not call on its own, and a compilation of its own would break the model's graph in three."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return ()
    get_encoder = getattr(model, "get_encoder", None)
    try:
        encoder = get_encoder() if callable(get_encoder) else None
    except Exception:  # noqa: BLE001 - a get_encoder that needs arguments or fails: nothing to add
        return ()
    path = next((name for name, module in model.named_modules() if module is encoder and name), None) \
        if isinstance(encoder, nn.Module) else None
    if path is None or COMPILED_ATTRIBUTE in encoder.__dict__:
        return ()
    _compile_with(encoder, config, options, calibration)   # the model's samples reach it through the model
    return (path,)


def _compile_with(module: nn.Module, config, options: dict, calibration: GraphCalls | None = None) -> None:
    """compile(module) with an existing config (the model's, lists included) and compile()'s own options."""
    if COMPILED_ATTRIBUTE in module.__dict__:
        restore_compiled(module)
    forward = CompiledForward(module, config, module.__dict__.get("forward"), options, calibration)
    module.__dict__[COMPILED_ATTRIBUTE] = module.__dict__["forward"] = forward


def _first_calls(forward: CompiledForward, args: tuple, kwargs: dict):
    """A call before any graph exists. If dynamo makes none, it skipped the model's frame (a graph break it cannot
    resume from, in a loop say): the call ran as written, fp32. Its result stands (correct, unconverted); from then
    on the model runs under torch.autocast with the level's dtype, said once with dynamo's reason."""
    unimplemented = torch._dynamo.utils.counters["unimplemented"]   # never reset: compare counts, not keys
    before = dict(unimplemented)
    out = _compiled_call(forward, args, kwargs)
    if not forward.converter.made_a_graph() and _dynamo_would_compile() and \
            any(True for _ in forward.model.parameters()):
        reasons = [reason for reason, count in unimplemented.items() if count > before.get(reason, 0)]
        why = reasons[-1].strip().splitlines()[0] if reasons else "no tensor op it could capture"
        forward.not_captured = (f"TorchDynamo captured no graph of {type(forward.model).__name__} ({why}): it ran as "
                                f"written; its calls run under torch.autocast({forward.config.low_dtype_name})")
        warnings.warn(f"amp_compiler: {forward.not_captured}", NotCapturedWarning, stacklevel=3)
    return out


def _dynamo_would_compile() -> bool:
    """False under torch.compiler.set_stance("force_eager") (or another stance that runs frames as written): no
    graph then says nothing about the model."""
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    return stance == "default"


class NotCapturedWarning(UserWarning):
    """TorchDynamo made no graph of a compiled model: it runs under torch.autocast instead."""


def _compiled_call(forward: CompiledForward, args: tuple, kwargs: dict):
    config = torch._dynamo.config
    saved = {name: getattr(config, name) for name in CAPTURE_SETTINGS}
    for name, value in CAPTURE_SETTINGS.items():
        setattr(config, name, max(value, saved[name]) if name == _LIMIT else value)
    made = len(forward.converter.graphs)
    try:
        return forward.compiled(forward.model, forward.own_forward, *args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        if len(forward.converter.graphs) != made:   # a new graph: did the weights become low since converting?
            _warn_if_made_low(forward)


def _low_dtypes(model: nn.Module) -> set:
    """The model's fp16/bf16 parameter dtypes; none for a model copy.deepcopy is still building (no parameters yet:
    the copy's state then gives the original's)."""
    from amp_compiler.frontend.capture import low_parameter_dtypes
    return set(low_parameter_dtypes(model)) if "_parameters" in model.__dict__ else set()


def _warn_if_made_low(forward: CompiledForward) -> None:
    """model.half() or .to(bfloat16) after converting: dynamo compiles again on the low weights (its guards see
    their dtype) and the graphs compute on the rounded weights, the fp32 masters gone. Said once, with what
    convert() says of such a model; checked when a graph is made, so a call pays nothing."""
    if forward.warned_low_parameters or forward.weights_cast_low:
        return
    from amp_compiler.frontend.capture import refuse_low_parameters
    if not _low_dtypes(forward.model) - forward.low_from_the_start:
        return
    try:
        refuse_low_parameters(forward.model)
    except ValueError as refusal:
        forward.warned_low_parameters = True
        warnings.warn(f"amp_compiler: {refusal} Its parameters became low after convert(..., inplace=True) "
                      "(model.half() or model.to(dtype)): the graphs made since compute on the rounded weights, "
                      "norms and softmax included, and the fp32 masters are gone.", UserWarning, stacklevel=5)


# dynamo settings for this model's frames only, set around its calls (10 us): where dynamo's defaults skip code, it
# runs as written, in fp32, with a log line at most (measured on the conformance models)
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"  # < 2.7
CAPTURE_SETTINGS = {name: value for name, value in {
    _LIMIT: RECOMPILE_LIMIT,                    # default 8 graphs per frame (the backend warns at the last one)
    "allow_rnn": True,                          # default: a graph break at nn.LSTM/GRU/RNN, which ran fp32
    "capture_dynamic_output_shape_ops": True,   # default: nonzero/index by mask skips a frame with a loop (an MoE)
}.items() if hasattr(torch._dynamo.config, name)}


class DispatchModeFallbackWarning(UserWarning):
    """A TorchDispatchMode was active at a call: dynamo runs frames as written under one, so the call ran autocast."""


def _under_autocast(forward: CompiledForward, args: tuple, kwargs: dict):
    """Under a user's TorchDispatchMode dynamo runs the frame as written (measured: every matmul fp32, silently), so
    the call runs as written inside torch.autocast(the level's dtype) instead, said once per model: the mode still
    sees every op, and the matmuls run low as autocast decides."""
    if forward.not_captured is None and not forward.warned_dispatch_mode:
        forward.warned_dispatch_mode = True
        warnings.warn(f"amp_compiler: a TorchDispatchMode ({type(_get_current_dispatch_mode()).__name__}) is active "
                      f"while {type(forward.model).__name__} is called: TorchDynamo would run it as written (fp32), "
                      f"so this call runs under torch.autocast({forward.config.low_dtype_name}) instead; call the "
                      "model outside the mode for its converted graphs", DispatchModeFallbackWarning, stacklevel=3)
    device = next((t.device.type for t in forward.model.parameters()), "cpu")
    written = forward.own_forward or types.MethodType(type(forward.model).forward, forward.model)
    with level_autocast(forward.config, device):
        return written(*args, **kwargs)


@dataclasses.dataclass
class CompiledChildren:
    """The record of a module whose submodules were compiled one by one (compile_children, compile_per_block)."""
    config: object
    children: list   # the paths of the compiled submodules (direct children for compile_children)
    note: str = ""   # why, for explain()
    runs_a_forward = False

    def graphs(self, model: nn.Module) -> list:
        return [(f"{name}.{path}" if path else name, gm, forward)
                for name, child, record in _still_compiled(model, self.children) for path, gm, forward in record.graphs(child)]

    def forwards(self, model: nn.Module) -> list[CompiledForward]:
        return [forward for _, child, record in _still_compiled(model, self.children) for forward in record.forwards(child)]

    explain, verify, compare = CompiledForward.explain, CompiledForward.verify, CompiledForward.compare


def compile_children(module: nn.Module, level: str = "O1", **options) -> nn.Module:
    """amp_compiler.compile on each direct child that holds parameters, the module itself left as written: for a
    module whose own forward is not what runs (a LightningModule's training_step calls its children). restore,
    explain and frozen_bytes take the module. Options are compile()'s."""
    if "calibration_data" in options:
        raise ValueError("calibration_data: the samples are the module's inputs, but its children are compiled one "
                         "by one and it has no compiled forward to run them through; convert the child its "
                         "training_step calls first (convert(module.model, level, inplace=True, calibration_data="
                         "its samples)), which this keeps")
    if compiled_record(module) is not None:
        restore_compiled(module)
    config = with_model_lists(make_config(level, **{k: v for k, v in options.items()
                                                    if k not in ("backend", "dynamic", "weight_cache")}), module)
    names = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    for name in names:
        if compiled_record(getattr(module, name)) is None:   # a child converted already keeps its conversion
            compile(getattr(module, name), level, **options)
    module.__dict__[COMPILED_ATTRIBUTE] = CompiledChildren(config, names)
    return module


def _still_compiled(model: nn.Module, paths) -> list[tuple[str, nn.Module, object]]:
    """(path, submodule, its record) for the submodules at `paths` that are still compiled (a user may restore
    one): the nested and per-child records a CompiledForward or CompiledChildren reaches its graphs through."""
    found = [(path, model.get_submodule(path)) for path in paths]
    return [(path, module, compiled_record(module)) for path, module in found if compiled_record(module) is not None]


def compiled_graphs(model: nn.Module) -> list[tuple[str, object, object]]:
    """(the module path the graph's paths are relative to, the graph, its CompiledForward) for every graph of a
    compiled model, or of its compiled children; [] for a model not compiled."""
    record = compiled_record(model)
    return record.graphs(model) if record is not None else []


def restore_compiled(model: nn.Module) -> nn.Module:
    """Undo amp_compiler.compile(model) (or compile_children): its forward as before, the graphs dropped with the
    compiled frame."""
    state = model.__dict__.pop(COMPILED_ATTRIBUTE)
    if isinstance(state, CompiledChildren):
        for name in state.children:
            child = model.get_submodule(name)
            if compiled_record(child) is not None:
                restore_compiled(child)
        return model
    model.__dict__.pop("forward", None)
    forget_graphs(model)
    if state.fp8_histories is not None:   # its state_dict keys go with it
        state.fp8_histories.remove_hooks()
    for handle in state.undo:   # hooks an integration added for this capture (Apex O2's input and output casts)
        handle.remove()
    for path in state.nested:
        nested = model.get_submodule(path)
        if compiled_record(nested) is not None:
            restore_compiled(nested)
    if state.own_forward is not None:
        model.__dict__["forward"] = state.own_forward
    return model


def history_stores(model: nn.Module) -> list[tuple[str, Fp8HistoryStore]]:
    """(the state_dict prefix of its keys, the amax histories) of a model converted in place at
    fp8_scaling="delayed": the model's own, or each compiled child's (compile_children, compile_per_block);
    [] for any other model."""
    if not isinstance(model, nn.Module):
        return []
    state = compiled_record(model)
    if isinstance(state, CompiledChildren):
        return [(f"{path}.{prefix}", store) for path in state.children
                for prefix, store in history_stores(model.get_submodule(path))]
    store = getattr(state, "fp8_histories", None)
    nested = [(f"{path}.{prefix}", inner) for path in getattr(state, "nested", ())   # its encoder's
              for prefix, inner in history_stores(model.get_submodule(path))]
    return ([("", store)] if store is not None else []) + nested


def _history_store(model: nn.Module, config):
    """fp8_scaling="delayed": the amax histories of every graph, by the matmul's module path, in the model's
    state_dict (fp8_histories.py); None otherwise."""
    if config.fp8 is None or config.fp8.scaling != "delayed":
        return None
    return Fp8HistoryStore(model, config.fp8.history)


def _forward_call(module: nn.Module, own_forward, *args, **kwargs):
    """The frame dynamo captures: the module's forward (nn_module_stack paths start L['module'])."""
    if own_forward is not None:
        return own_forward(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _frame_of_its_own():
    """_forward_call on a code object of its own: dynamo caches graphs per code object and stops compiling one after
    its recompile limit (8), so one code object shared by every compiled model left the ninth model uncompiled."""
    code = _forward_call.__code__.replace()
    return types.FunctionType(code, _forward_call.__globals__, _forward_call.__name__)
