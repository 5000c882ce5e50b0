"""capture(): the one place a model is traced. Everything after it is a pass on the captured graph.

    model --fx symbolic trace (untraceable parts become opaque nodes)--> CapturedGraph
          --parts were untraceable and example_inputs are given: torch.export, when it captures it all
          --fx failed at the top: torch.export, else TracingError naming the line
A CapturedGraph is compiled by convert.compile_graph, which copies it: one capture can be compiled many
times (export_onnx compiles it again with force_fp32 when a weight exceeds fp16's range). Its GraphModule
holds a shallow copy of the module tree (the user's tensors, never the user's module objects), which the
capture owns: graph passes before compilation (fold_batch_norms) may replace modules in it.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.frontend.errors import TracingError, user_frame
from amp_compiler.frontend.example_inputs import check_input_count
from amp_compiler.frontend.export_capture import export_failure, export_graph, parameters_read_as_constants
from amp_compiler.frontend.integrations import prepare_for_export
from amp_compiler.frontend.fx_capture import (AmpTracer, baked_arguments, baked_in_place, is_leaf_module,
                                              restore_output_type)
from amp_compiler.frontend.hooks import hook_kinds, hooked_modules, move_root_hooks, user_hooks_silenced
from amp_compiler.frontend.module_tree import code_on_first_use, graph_module_on, share_module_tree, unwrap_compiled
from amp_compiler.frontend.repeated_blocks import repeated_blocks
from amp_compiler.frontend.training_reads import read_flags, training_reads_recorded
from amp_compiler.passes.node_facts import facts


@dataclass
class CapturedGraph:
    """A captured model: the graph on the capture's own module tree, and what the front end learned."""
    graph_module: fx.GraphModule
    frontend: str                       # "fx.symbolic_trace" | "torch.export"
    leaves: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    opaque: dict[str, str] = field(default_factory=dict)   # what runs as written, and why
    hooked: dict[str, list[str]] = field(default_factory=dict)        # module path -> its user hooks
    training_reads: dict[str, bool] = field(default_factory=dict)     # module path -> `training` it read
    model: nn.Module | None = None      # the user's model (unwrapped from torch.compile): never changed
    example_inputs: tuple | None = None
    dynamic_shapes: object = None


def capture(model: nn.Module, example_inputs=None, dynamic_shapes=None) -> CapturedGraph:
    """Trace `model` once (torch.fx, else torch.export); the user's model is never changed."""
    captured = _capture(model, example_inputs, dynamic_shapes)
    captured.model, captured.dynamic_shapes = unwrap_compiled(model)[0], dynamic_shapes
    if captured.example_inputs is None:   # fx sets them: one value per graph input
        captured.example_inputs = example_inputs
    return captured


def graph_module_to_compile(captured: CapturedGraph, *, generate_code: bool = True,
                            spend: bool = False) -> fx.GraphModule:
    """A GraphModule the passes may rewrite: a copy of the captured graph (same node names, same generated
    code; each node's meta copied, so facts a pass writes stay on the copy) on the capture's module objects
    (its own copy of the user's tree: the passes add attributes to the GraphModule, never to its modules),
    with the model's own hooks. Compiling it never changes `captured`'s graph. generate_code=False: its code is
    left to the caller's gm.recompile() after the passes (graph_module_on). spend=True (a caller that compiles the
    capture once, convert()): the capture's own graph, not a copy, and `captured` cannot be compiled again."""
    source = captured.graph_module
    if spend:
        graph, captured.graph_module = source.graph, None   # compiling it again fails loudly, never on an edited graph
    else:
        graph = copy.deepcopy(source.graph)   # fx.Graph's own deepcopy: nodes by name, codegen (output type)
        for node in graph.nodes:
            node.meta = {key: _copied(value) for key, value in node.meta.items()}
    # The same module objects, not a copy: the capture is garbage once compiled, and a copy it held would keep
    # weights a load_state_dict(assign=True) replaced alive (frozen copies of them too) until a gc cycle.
    gm = graph_module_on(source, graph, type(source).__name__, generate_code=generate_code)
    move_root_hooks(source, gm)
    gm.meta.update(source.meta)
    return gm


def _copied(value):
    # facts (meta["amp"]) and the front end's dicts/lists are edited by passes; tensors and fake values are not
    if isinstance(value, dict):
        return {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in value.items()}
    return copy.copy(value) if isinstance(value, (list, set)) else value


def _capture(model: nn.Module, example_inputs, dynamic_shapes) -> CapturedGraph:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() needs a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, "
                        f"got {type(example_inputs).__name__}")
    model, notes = unwrap_compiled(model)
    _check_dtypes(model, example_inputs)
    check_input_count(model, example_inputs)
    root = share_module_tree(model)
    tracer = AmpTracer()
    concrete = baked_arguments(root, example_inputs)
    try:
        with training_reads_recorded(root, skip=is_leaf_module) as reads:   # leaves follow train()/eval()
            tracer.training_reads = reads
            graph = tracer.trace(root, concrete_args=concrete or None)
    except Exception as fx_error:  # noqa: BLE001 - any fx failure means: try the next front end
        return _export_fallback(model, example_inputs, dynamic_shapes, fx_error, notes)
    untraceable = {k: v for k, v in tracer.opaque.items()
                   if "autograd.Function" not in v and k not in tracer.kept_for_hooks}
    if untraceable and example_inputs is not None:
        try:  # torch.export may capture what fx could not: then nothing runs opaque
            return _export(model, example_inputs, dynamic_shapes,
                           notes + [f"torch.fx could not trace {', '.join(sorted(untraceable))}"])
        except Exception:  # noqa: BLE001 - keep the fx graph with its opaque parts
            pass
    for node in graph.nodes:
        # fx records `x: torch.Tensor` annotations as a string global that torch.save cannot pickle
        # (the plain symbolic_trace GraphModule fails the same way); they change nothing at run time.
        if node.op in ("placeholder", "output"):
            node.type = None
        if node.op == "call_module" and hook_kinds(root.get_submodule(node.target)):
            facts(node)["hooks"] = hook_kinds(root.get_submodule(node.target))   # never lowered: they fire
    baked_in_place(graph, concrete, type(model).__name__)
    restore_output_type(graph, tracer.output_spec)
    gm = code_on_first_use(graph_module_on(root, graph, type(model).__name__ + "Amp", generate_code=False))
    move_root_hooks(root, gm)
    leaves = sorted({n.target for n in graph.nodes if n.op == "call_module"})
    if concrete:
        notes.append(f"traced with {', '.join(f'{name}={value!r}' for name, value in concrete.items())} baked in "
                     "(Python values are constants of the graph); a call that passes another value raises (convert "
                     "again with it in example_inputs)")
    notes += [f"opaque, runs as written: {where}: {why}" for where, why in tracer.opaque.items()]
    return CapturedGraph(gm, "fx.symbolic_trace", leaves, notes, dict(tracer.opaque), hooked_modules(root),
                       read_flags(root, tracer.training_reads),
                       example_inputs=_with_baked_defaults(root, example_inputs, concrete))


def _with_baked_defaults(root: nn.Module, example_inputs, baked: dict):
    """example_inputs followed by the baked defaults of the arguments after them: a value per placeholder, so
    fake values propagate (a forward(x, mask=None) converted with (x,) had none: the counts differed)."""
    if example_inputs is None:
        return None
    rest = list(inspect.signature(root.forward).parameters.values())[len(example_inputs):]
    if not all(p.kind == p.POSITIONAL_OR_KEYWORD and p.name in baked for p in rest):
        return example_inputs
    return example_inputs + tuple(baked[p.name] for p in rest)


def _follows_mode_when_exported(module: nn.Module) -> bool:
    # export_capture makes their baked train flags follow train()/eval()
    return isinstance(module, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm))


def _export(model, example_inputs, dynamic_shapes, notes) -> CapturedGraph:
    notes = notes + prepare_for_export(model)
    root = share_module_tree(model)
    repeat = repeated_blocks(root)   # identical blocks: a few are exported, the others copied (repeated_blocks.py)
    with training_reads_recorded(root, skip=_follows_mode_when_exported) as reads, user_hooks_silenced():
        gm, export_notes = export_graph(model, root, example_inputs, dynamic_shapes, repeat)
    if repeat is not None and repeat.refused is None:
        reads = repeat.extend_reads(reads)
    constants = parameters_read_as_constants(gm, model)
    if constants:   # no gradient would reach them: a silent wrong training step
        raise TracingError(f"torch.export took the parameters {', '.join(constants[:4])} of {type(model).__name__} "
                           "as constants (a module reached through a plain attribute, not a registered child): no "
                           "gradient would reach them. Register that module as a child (self.x = module), or pass it in.")
    return CapturedGraph(gm, "torch.export", [], notes + export_notes, hooked=hooked_modules(root),
                       training_reads=read_flags(root, reads))


def _export_fallback(model, example_inputs, dynamic_shapes, fx_error, notes) -> CapturedGraph:
    if example_inputs is None:
        raise TracingError(
            f"torch.fx could not trace {type(model).__name__}: {type(fx_error).__name__}: {fx_error}"
            f"{user_frame(fx_error)}. This is usually Python control flow on tensor shapes or values. Pass "
            "example_inputs=(x, ...) so convert() can fall back to torch.export, or rewrite that "
            "branch with torch.where / torch.cond.") from fx_error
    try:
        return _export(model, example_inputs, dynamic_shapes,
                       notes + ["torch.fx could not trace the model (" +
                                f"{type(fx_error).__name__}: {fx_error}"[:160] + ")"])
    except TracingError:
        raise
    except Exception as export_error:  # noqa: BLE001
        raise export_failure(model, fx_error, export_error) from export_error


def low_parameter_dtypes(model: nn.Module) -> list[str]:
    """The fp16/bf16 dtypes among the model's parameters (an fp32 model: none)."""
    return sorted({str(p.dtype) for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)})


def refuse_low_parameters(model: nn.Module) -> None:
    """Mixed precision starts from an fp32 model: its fp32 parameters stay the masters."""
    low = low_parameter_dtypes(model)
    if low:
        raise ValueError(f"{type(model).__name__} has {', '.join(low)} parameters: mixed precision starts from "
                         "an fp32 model (the fp32 parameters stay the masters). Call model.float() first.")


def _check_dtypes(model: nn.Module, example_inputs) -> None:
    """Refuse at convert time what would only fail (or do nothing) at call time."""
    refuse_low_parameters(model)
    if example_inputs is None:
        return
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for index, value in enumerate(torch.utils._pytree.tree_leaves(example_inputs)):
        if isinstance(value, torch.Tensor) and value.dtype == torch.float64 and torch.float32 in floats:
            raise ValueError(f"example input {index} is float64 but the model's parameters are float32: give "
                             "example_inputs in the dtype the model will be called with (float64 is never cast)")
