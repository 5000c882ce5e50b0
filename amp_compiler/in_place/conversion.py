"""convert(model, inplace=True): the model object stays the user's; parts of it run captured graphs.

    model.forward = PartForward(root part)       same class, methods, signature, parameters, state_dict
    first call -> the root captures on the inputs it gets (lazy: no example inputs needed)
               -> it cannot (a KV cache argument, untraceable code): it runs as written and its children
                  become parts, level by level down to Linear/Conv leaves, which always capture
restore(model) puts the original forwards back. Nothing here registers a module, parameter or buffer on
the user's model: graphs and frozen copies live on the parts, outside the module tree (fp8 delayed scaling adds
state_dict hooks for its amax histories: fp8_histories.py).
"""
from __future__ import annotations

import dataclasses
import sys
import warnings

import torch
from torch import nn

from amp_compiler.config import AmpConfig
from amp_compiler.frontend import TracingError, capture, share_module_tree
from amp_compiler.frontend.hooks import HOOK_DICTS
from amp_compiler.frontend.capture import refuse_low_parameters
from amp_compiler.in_place.call_key import Uncapturable, call_key
from amp_compiler.in_place import reuse
from amp_compiler.in_place.fp8_histories import Fp8HistoryStore, history_stores
from amp_compiler.frontend.export_capture import parameters_read_as_constants
from amp_compiler.in_place.guards import ModuleState, assigned_attributes, grad_mode_changes
from amp_compiler.in_place.part import Graph, Part, PartForward, bound_call, low_node_count

ATTRIBUTE = "_amp_in_place"   # on the user's model: its InPlaceConversion


@dataclasses.dataclass
class InPlaceConversion:
    model: nn.Module
    config: AmpConfig
    freeze: bool = False
    calibration: dict = dataclasses.field(default_factory=dict)   # id(module) -> [(args, kwargs)] it received
    parts: dict = dataclasses.field(default_factory=dict)         # path -> Part
    sample_values: bool = True    # freeze(model, sample_values=...): for the graphs captured later too
    captured: int = 0             # captures so far: each graph's gm.meta["amp"]["capture"] (the latest shows)
    # amp_compiler.initialize (Apex's O2/O3) casts the weights low after converting (its optimizer steps fp32
    # masters): a capture sees fp32 copies of them, so the graph is the one convert() builds for the fp32
    # model, and its casts of the weights are no-ops at run time
    weights_cast_low: bool = False
    # freeze: one value comparison per model call for all frozen graphs (amp_compiler.frozen.JoinedValueCheck)
    values_checked: object = None
    calling: bool = False         # a model call is running: a part called now is nested in it
    pack_linears: bool = False    # amp_compiler.frozen.pack_linears(model): frozen Linear copies oneDNN-packed
    templates: dict = dataclasses.field(default_factory=reuse.Templates)   # signature -> graph to reuse
    reused: int = 0               # graphs bound from a template instead of captured (reuse.py)
    fp8_histories: object = None  # fp8 delayed scaling: the amax histories, in the model's state_dict
    warned_low_parameters: bool = False   # the model was made fp16/bf16 after converting: said once

    def before_outermost_call(self) -> None:
        """Once per model call, before any part runs: the frozen copies whose weights' values changed go; a model
        made fp16/bf16 since converting is told so (its first floating parameter is read: model.half() casts all,
        a part cast alone is met when its capture refuses it)."""
        if self.values_checked is not None:
            self.values_checked.check()
        if not self.warned_low_parameters:
            first = next((p for p in self.model.parameters() if p.is_floating_point()), None)
            if first is not None and first.dtype in (torch.float16, torch.bfloat16):
                self.warn_if_made_low(self.model)

    def warn_if_made_low(self, module: nn.Module) -> None:
        """`module` has fp16/bf16 parameters (model.half() or .to(bfloat16) after converting): say once what
        convert() says of such a model. Every later capture refuses them (the parts run plain low, norms
        included), and the graphs captured before compute with the rounded weights."""
        if self.warned_low_parameters or self.weights_cast_low:   # Apex's O2/O3 cast them on purpose
            return
        try:
            refuse_low_parameters(self.model if any(True for _ in self.model.parameters()) else module)
        except ValueError as refusal:
            self.warned_low_parameters = True
            warnings.warn(f"amp_compiler: {refusal} Its parameters became low after convert(..., inplace=True) "
                          "(model.half() or model.to(dtype)): the graphs captured before compute with the rounded "
                          "weights, and no part can be captured any more (those run as written in that dtype, "
                          "attention and norms included).", UserWarning, stacklevel=6)

    def _joined_check(self):
        if self.values_checked is None:
            from amp_compiler.frozen import JoinedValueCheck   # frozen imports this module
            self.values_checked = JoinedValueCheck()
        return self.values_checked

    def add_part(self, module: nn.Module, path: str) -> Part:
        own = module.__dict__.get("forward")
        if getattr(own, "_amp_part_forward", False):   # one module reached by two paths (shared blocks)
            return own.part
        part = Part(module, path, self, own_forward=own)
        module.__dict__["forward"] = PartForward(part)   # the class's forward is untouched
        self.parts[path] = part
        return part

    def capture(self, part: Part, args: tuple, kwargs: dict, tensors: list) -> Graph:
        """Capture `part.module` called as (args, kwargs) and compile it with this conversion's config, or bind
        the graph of a structurally identical block captured before to this part's own modules (reuse.py)."""
        sharded = fsdp_sharded_submodule(part.module)
        if sharded:   # one graph would inline it: FSDP2's hooks would never gather its parameters
            raise TracingError(f"its submodule {sharded} is sharded with FSDP2 (fully_shard), which gathers the "
                               "parameters around that module's own call: the submodule is a part of its own")
        wrapper = _capture_wrapper(part, args, kwargs, len(tensors))
        # a block like one captured before (an LLM's layers): its graph, on this block's own modules (the model
        # itself is like no other part; calibrated graphs hold ranges of their own block's values)
        repeatable = part.path and not self.calibration
        signature = reuse.signature(part, args, kwargs, tensors) if repeatable else None
        template = self.templates.get(signature) if signature is not None else None
        gm = template.bind(wrapper) if template is not None else None
        if gm is not None:
            self.reused += 1
        else:
            gm = self._capture_and_compile(part, wrapper, args, kwargs, tensors)
            self.captured += 1
            template = reuse.template_of(gm, part) if signature is not None else None
            if template is not None:
                self.templates[signature] = template
        training_reads = gm.meta["amp"]["training_reads"]
        _read_live_tensors(gm, part.module)
        watched = [(part.module.get_submodule(path.removeprefix("inner").lstrip(".")), flag)
                   for path, flag in training_reads.items() if path.startswith("inner")]
        watched += _called_modules_flags(gm, part.module)
        gm.meta["amp"]["part"] = part.path
        gm.meta["amp"]["capture"] = self.captured + self.reused   # the order graphs were made in (latest shows)
        if self.fp8_histories is not None:   # before freezing: frozen fp8 weights follow the histories
            self.fp8_histories.bind(gm, part.path)
        if self.freeze:
            _freeze_graph(gm, part.module.training, self)
        return Graph(gm, watched, low_node_count(gm), ModuleState(part.module))

    def _capture_and_compile(self, part: Part, wrapper, args: tuple, kwargs: dict, tensors: list):
        from amp_compiler.convert import compile_graph   # convert imports this module
        example = tuple(t.detach() for t in tensors)
        samples = self._calibration_samples(part, call_key(args, kwargs)[0])
        fp32_weights = _fp32_while_captured(part.module, self.weights_cast_low)
        with torch.inference_mode(False), torch.enable_grad(), fp32_weights:
            with grad_mode_changes() as switched:
                captured = capture(wrapper, example)
            opaque = _opaque_modules_with_parameters(wrapper, captured.opaque)
            if opaque:   # they would run under autocast: the part runs as written and its children are tried
                raise TracingError(f"{opaque[0].removeprefix('inner').lstrip('.') or 'it'} cannot be traced: "
                                   f"{captured.opaque[opaque[0]]}")
            _refuse_what_a_graph_cannot_do(captured, part.module, switched, self.model)
            return compile_graph(captured, self.config, samples, follow_flags=False)

    def freeze_graphs(self, sample_values: bool = True) -> None:
        """amp_compiler.freeze(model): the graphs captured so far keep weight copies, and those captured later."""
        self.freeze, self.sample_values = True, sample_values
        for part in self.parts.values():
            for key, graphs in part.graphs.items():
                for graph in graphs:
                    _freeze_graph(graph.gm, key[0], self)   # key[0]: the module's training flag

    def graph_modules(self) -> list:
        return [graph.gm for part in self.parts.values() for graphs in part.graphs.values() for graph in graphs]

    def _calibration_samples(self, part: Part, key) -> list | None:
        if not self.calibration:
            return None
        samples = []
        for args, kwargs in self.calibration.get(id(part.module), ()):
            try:
                sample_key, sample_tensors = call_key(args, kwargs)
            except Uncapturable:
                continue
            if sample_key == key:   # calls like the one captured: same graph inputs
                samples.append(tuple(sample_tensors))
        return samples


def _capture_wrapper(part: Part, args: tuple, kwargs: dict, count: int) -> nn.Module:
    """BoundCall on a copy of the part's module tree that shares its tensors: what a capture traces."""
    inner = share_module_tree(part.module)
    # what the part runs as written, never a wrapper put on its forward since (it would call the part again)
    inner.__dict__.pop("forward", None)
    if part.own_forward is not None:
        inner.__dict__["forward"] = part.own_forward
    for name in HOOK_DICTS:   # the part's own hooks fire around its call, not again inside the graph
        if name in inner.__dict__:
            inner.__dict__[name].clear()
    return bound_call(inner, args, kwargs, count)


def fsdp_module_type() -> type | None:
    """FSDP2's FSDPModule (what fully_shard makes a module), or None when torch.distributed.fsdp is not imported:
    then nothing can be sharded."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def fsdp_sharded_submodule(module: nn.Module) -> str | None:
    """The path of a module below `module` that FSDP2's fully_shard manages, if any (the part itself may be one:
    FSDP's hooks around the part's call gather its parameters into the dicts its graph reads)."""
    sharded_type = fsdp_module_type()
    if sharded_type is None:
        return None
    return next((path for path, child in module.named_modules() if path and isinstance(child, sharded_type)), None)


def _refuse_what_a_graph_cannot_do(captured, module: nn.Module, switched: list, model: nn.Module) -> None:
    """A forward whose effects are not tensor ops runs as written (its children are tried as parts)."""
    if switched:
        raise TracingError(f"its forward switches autograd ({', '.join(sorted(set(switched)))}); a graph records "
                           "tensor ops only and would compute gradients where the forward turned them off")
    traced = captured.graph_module._modules.get("inner")   # the capture's copy (absent from torch.export's)
    assigned = assigned_attributes(traced, module) if traced is not None else []
    if assigned:
        raise TracingError(f"its forward assigns {', '.join(assigned[:4])} (self.<name> = ...); a graph would "
                           "not, and the model would never see the new value")
    constants = parameters_read_as_constants(captured.graph_module, model)
    if constants:
        raise TracingError(f"the capture took {', '.join(constants[:4])} as constants (a module reached through a "
                           "plain attribute, not a registered child): no gradient would reach them")


def _opaque_modules_with_parameters(wrapper: nn.Module, opaque: dict) -> list[str]:
    """The modules holding parameters that fx could not trace: convert() would run them under autocast; in
    place they are parts of their own instead (through their parent running as written)."""
    found = []
    for path in opaque:
        try:
            module = wrapper.get_submodule(path)
        except AttributeError:   # an opaque function, not a module
            continue
        if any(True for _ in module.parameters()):
            found.append(path)
    return found


def _read_live_tensors(gm: nn.Module, module: nn.Module) -> None:
    """The graph's copies of the part's modules share the user's modules' parameter and buffer dicts, so a
    tensor put there later (load_state_dict(assign=True), FSDP2's unsharded parameters, a new Parameter) is
    the one the graph reads, never a stale one."""
    inner = gm._modules.get("inner")
    if inner is None:   # the torch.export front end lifts parameters onto the graph itself
        return
    live = dict(module.named_modules(remove_duplicate=False))
    for path, copy in inner.named_modules(remove_duplicate=False):
        original = live.get(path)
        if original is None or type(original) is not type(copy):
            continue
        if copy._parameters.keys() == original._parameters.keys():
            copy._parameters = original._parameters
        if copy._buffers.keys() == original._buffers.keys():
            copy._buffers = original._buffers
        copy.training = original.training   # the GraphModule gave every copy the root's flag


def _called_modules_flags(gm: nn.Module, module: nn.Module) -> list:
    """(user's module, flag) for the modules the graph calls (dropout, batch norm follow their own flag): a
    graph is used only while each still has the flag its copy has, so `model.backbone.eval()` alone counts."""
    called = {node.target.removeprefix("inner.") for node in gm.graph.nodes
              if node.op == "call_module" and node.target.startswith("inner.")}
    return [(module.get_submodule(path), module.get_submodule(path).training) for path in sorted(called)]


def _freeze_graph(gm, training: bool, conversion: InPlaceConversion) -> None:
    from amp_compiler.frozen import HOLDER, freeze, pack_frozen_linears
    if not hasattr(gm, HOLDER):
        freeze(gm, sample_values=conversion.sample_values)
        holder = gm.get_submodule(HOLDER)
        holder.train(training)   # the copies serve eval calls; gm.training is the capture's
        if conversion.sample_values:   # compared once per model call with all the others, not per graph call
            conversion._joined_check().add(holder)
    if conversion.pack_linears:
        pack_frozen_linears(gm)


def convert_in_place(model: nn.Module, config: AmpConfig, *, example_inputs=None, calibration_data=None,
                     freeze: bool = False) -> nn.Module:
    if isinstance(model, nn.Module):
        from amp_compiler.dynamo.compile import compiled_state   # the dynamo package imports this module
        if compiled_state(model) is not None:
            raise ValueError(f"{type(model).__name__} is compiled by amp_compiler (capture='dynamo' or "
                             "amp_compiler.compile): call amp_compiler.restore(model) first to convert it with parts")
    refuse_in_place_request(model, example_inputs)
    conversion = InPlaceConversion(model, config, freeze)
    if config.fp8 is not None and config.fp8.scaling == "delayed":
        conversion.fp8_histories = Fp8HistoryStore(model, config.fp8.history)
    if calibration_data is not None:
        conversion.calibration = _record_calls(model, calibration_data)
    model.__dict__[ATTRIBUTE] = conversion
    conversion.add_part(model, "")
    _add_encoder_part(conversion, model)
    capture_now(model, example_inputs)
    return model


def refuse_in_place_request(model, example_inputs) -> None:
    """What either capture refuses before converting in place: no module, a model parts converted already,
    example_inputs that are not a tuple, low-precision parameters (refuse_low_parameters says why)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() needs a torch.nn.Module, got {type(model).__name__}")
    if ATTRIBUTE in model.__dict__:
        raise ValueError(f"{type(model).__name__} is already converted in place (level "
                         f"{model.__dict__[ATTRIBUTE].config.level}); call amp_compiler.restore(model) first to "
                         "convert it again with other options")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, "
                        f"got {type(example_inputs).__name__}")
    refuse_low_parameters(model)


def capture_now(model: nn.Module, example_inputs: tuple | None) -> None:
    """With example_inputs: one call at conversion, so the graphs exist before the first real one; its effects
    (buffers, fp8 histories) undone."""
    if example_inputs is not None:
        with undone_effects(model), torch.no_grad():
            model(*example_inputs)


def _add_encoder_part(conversion: InPlaceConversion, model: nn.Module) -> None:
    """An encoder-decoder's generate() calls model.get_encoder() itself, before the model's first forward:
    the encoder is a part from the start (else that first generate ran it fp32, as written)."""
    get_encoder = getattr(model, "get_encoder", None)
    try:
        encoder = get_encoder() if callable(get_encoder) else None
    except Exception:  # noqa: BLE001 - a get_encoder that needs arguments or fails: nothing to add
        return
    if isinstance(encoder, nn.Module) and encoder is not model:
        path = next((name for name, module in model.named_modules() if module is encoder), None)
        if path:
            conversion.add_part(encoder, path)


def in_place_conversion(model: nn.Module) -> InPlaceConversion | None:
    return model.__dict__.get(ATTRIBUTE) if isinstance(model, nn.Module) else None


def converted_in_place(model: nn.Module):
    """The record of an in-place conversion on either capture: the parts' InPlaceConversion, or the CompiledForward
    of capture="dynamo" / amp_compiler.compile (of the model, or of its children: CompiledChildren); None if
    neither. Each has `.config`."""
    from amp_compiler.dynamo.compile import compiled_state   # the dynamo package imports this module
    return in_place_conversion(model) or compiled_state(model)


def restore(model: nn.Module) -> nn.Module:
    """Undo convert(model, inplace=True) or amp_compiler.compile(model): every converted module's own forward is
    back, graphs dropped."""
    from amp_compiler.dynamo.compile import compiled_state, restore_compiled   # dynamo imports convert, this
    conversion = in_place_conversion(model)
    if conversion is None and compiled_state(model) is not None:
        return restore_compiled(model)
    if conversion is None:
        raise TypeError(f"restore() takes a model converted with convert(model, inplace=True) or compiled by "
                        "amp_compiler.compile; "
                        f"{type(model).__name__} is not")
    for part in conversion.parts.values():
        if part.own_forward is not None:
            part.module.__dict__["forward"] = part.own_forward
        else:
            part.module.__dict__.pop("forward", None)
    if conversion.fp8_histories is not None:
        conversion.fp8_histories.remove_hooks()
    del model.__dict__[ATTRIBUTE]
    return model


class _fp32_while_captured:
    """The module's fp16/bf16 parameters and buffers hold fp32 copies for the time of a capture."""

    def __init__(self, module: nn.Module, enabled: bool):
        tensors = (*module.parameters(), *module.buffers()) if enabled else ()
        self.low = [(t, t.data, t.grad) for t in tensors if t.dtype in (torch.float16, torch.bfloat16)]

    def __enter__(self):
        # a low gradient on the fp32 copy makes fake-tensor propagation fail (eval after a training step)
        for tensor, data, _ in self.low:
            tensor.grad = None
            tensor.data = data.float()

    def __exit__(self, *exc):
        for tensor, data, grad in self.low:
            tensor.data = data
            tensor.grad = grad


class undone_effects:
    """Buffers (batch-norm statistics, counters) and fp8 amax histories as they were before a conversion-time
    call: the example inputs' amax must not be the first entry training's delayed scales are taken from."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.saved = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.histories = [store.tensors for _, store in history_stores(self.model)]   # live: new keys too
        self.saved_histories = [{key: {name: t.clone() for name, t in tensors.items()}
                                 for key, tensors in histories.items()} for histories in self.histories]

    def __exit__(self, *exc):
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
            for histories, saved_histories in zip(self.histories, self.saved_histories):
                for key, tensors in histories.items():   # made by this call's capture: empty, as a fresh one
                    for name, tensor in tensors.items():
                        saved = saved_histories.get(key, {}).get(name)
                        tensor.copy_(saved) if saved is not None else tensor.zero_()


def _record_calls(model: nn.Module, samples) -> dict:
    """id(module) -> the (args, kwargs) of each call it received in fp32 runs of the samples."""
    from amp_compiler.passes.painting.calibrate_ranges import check_calibration_data
    check_calibration_data(samples)
    calls: dict = {}

    def record(module, args, kwargs):
        calls.setdefault(id(module), []).append((args, dict(kwargs)))

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in model.modules()
               if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.parameters())]
    try:
        with undone_effects(model), torch.no_grad():
            for index, sample in enumerate(samples):
                inputs = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
                try:
                    model(*inputs)
                except Exception as error:  # noqa: BLE001 - the sample is named
                    raise ValueError(f"calibration_data sample {index}: the model fails on it: "
                                     f"{type(error).__name__}: {error}") from error
    finally:
        for handle in handles:
            handle.remove()
    return calls
