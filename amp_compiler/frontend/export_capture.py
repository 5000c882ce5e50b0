"""torch.export fallback: capture what fx cannot, keeping what the exported program promises.

    dynamic dims   every dim of every example tensor starts as Dim.AUTO (given by argument name, so
                   `forward(self, *args)` gets them too): torch.export keeps dynamic what the model allows
                   (batch, sequence, node counts) and fixes the rest; the notes say which. Where that
                   fails, batch-only, then all fixed, with a note saying why. A dim whose shape reasoning
                   passes GUARDS_BEFORE_FIXED guards (Swin's padded windows) is fixed, and the notes say so
    guards         the exported `_guards_fn` stays in the graph, behind a check of the fixed dims: a call
                   outside what the graph was specialised to raises a ValueError naming the input, the dim
                   and the captured size; it never computes the wrong branch
    dtype asserts  torch.export's `_assert_tensor_metadata` lose their dtype: the graph changes dtypes on purpose
    signature      the exported in/out pytree specs: dict inputs, keyword inputs and the model's own output
                   type (ModelOutput, namedtuple, OrderedDict) survive
    train flags    dropout / batch-norm train flags follow train()/eval() (batch norms without running
                   statistics, e.g. weight standardisation, keep their hard-coded flag)
A custom autograd.Function would be inlined by torch.export (its backward lost): that is refused.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import re

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, is_concrete_int
from torch.fx.experimental import _config as symbolic_config

from amp_compiler.frontend.errors import TracingError, user_frame
from amp_compiler.frontend.function_apply import intercepted_function_apply
from amp_compiler.frontend.module_tree import code_on_first_use, graph_module_on
from amp_compiler.frontend.repeated_blocks import Repeat
from amp_compiler.passes.fx.runtime import dropout_p_when_training   # generated code calls it: see runtime.py


def export_graph(model: nn.Module, root: nn.Module, example_inputs: tuple, dynamic_shapes=None,
                 repeat: Repeat | None = None):
    """(GraphModule on `root`, notes). Raises what torch.export raised. `repeat` (repeated_blocks.py): export
    with 4 of its blocks and copy the others; when that does not hold, the whole model is exported."""
    notes = []
    with _custom_functions_recorded() as functions:
        spliced = _spliced_export(root, example_inputs, dynamic_shapes, repeat, notes) if repeat else None
        if spliced is None:
            unlifted, why_fixed = _export(root, example_inputs, dynamic_shapes, notes)
            spliced = _graph_of(unlifted), unlifted, why_fixed
    graph, unlifted, why_fixed = spliced
    if functions:
        names = ", ".join(sorted(functions))
        raise TracingError(
            f"{type(model).__name__} calls custom autograd.Function {names}, and torch.export (the fallback "
            "for models torch.fx cannot trace) inlines its forward and drops its backward: gradients would "
            "be silently wrong. Make the code around it traceable by torch.fx (which keeps the Function "
            "whole), or convert the submodules that trace on their own.")
    for node in graph.nodes:  # constants torch.export lifted out of the code, and the guards, live on `unlifted`
        if node.op in ("get_attr", "call_module") and not _has_attr(root, node.target):
            _set_attr(root, node.target, operator.attrgetter(node.target)(unlifted))
    notes.append(_training_flags_note(_make_training_flags_live(root, graph)))
    if _devices_follow_parameters(root, graph):
        notes.append("built on the meta device: the device torch.export wrote into tensor factories (arange, zeros) "
                     "is the first parameter's at run time, so to_empty(device=...) + load_state_dict gives a working "
                     "model (non-persistent buffers, e.g. rotary inv_freq, are not in a state_dict: set them too)")
    fixed = _fixed_dims(graph)
    notes.extend(f"input {name}: dim {', '.join(f'{d}={n}' for d, n in dims.items())} fixed ({why_fixed}); "
                 "calls with another size there raise; convert(..., dynamic_shapes=...) or another example "
                 "size changes that" for name, dims in fixed.items())
    _guard_fixed_dims(root, graph, fixed, why_fixed)
    _drop_dtype_assertions(graph)
    return code_on_first_use(graph_module_on(root, graph, type(model).__name__ + "Amp", generate_code=False)), notes


def _export(root: nn.Module, example_inputs: tuple, dynamic_shapes, notes: list[str]):
    """(the exported program's unlifted GraphModule, why its fixed dims are fixed)."""
    if dynamic_shapes is not None:
        exported = torch.export.export(root, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
        return exported.module(), "fixed by the model or by dynamic_shapes"
    exported, why_fixed = _export_as_dynamic_as_possible(root, example_inputs, notes)
    return exported.module(), why_fixed


def _graph_of(unlifted: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    values: dict = {}
    for node in unlifted.graph.nodes:
        values[node] = graph.node_copy(node, lambda n: values[n])
    graph._codegen = copy.deepcopy(unlifted.graph._codegen)   # flattens inputs, rebuilds the output type
    return graph


def _spliced_export(root: nn.Module, example_inputs: tuple, dynamic_shapes, repeat: Repeat, notes: list[str]):
    """(graph, unlifted GraphModule, why_fixed) from an export of 4 of `repeat`'s blocks with the others copied
    in, or None (repeat.refused says why; the caller exports it all)."""
    short_notes: list[str] = []
    try:
        with repeat.few_blocks():
            unlifted, why_fixed = _export(root, example_inputs, dynamic_shapes, short_notes)
            graph = repeat.splice(_graph_of(unlifted))
    except Exception as error:  # noqa: BLE001 - NotSpliceable, or a forward that needs all its blocks
        if isinstance(error, GuardOnDataDependentSymNode):   # a branch on values: the whole model has it too
            raise
        repeat.refused = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        return None
    notes += short_notes + [f"{repeat.path}: {repeat.count} identical blocks; blocks 0, 1, 2 and {repeat.count - 1} "
                            f"exported, the others copied from block 2 (capture once per repeated block)"]
    return graph, unlifted, why_fixed


# torch.export's shape reasoning (sympy) grows with the guards it has issued on a dim: each new size question is
# simplified against all of them. Swin pads every stage to a multiple of its window and merges patches
# ((H + H % 2) // 2), so its reshapes ask about ever deeper FloorDiv/Mod expressions: torchvision swin_t at 64x64
# issues 247 guards on H and W and its export takes 120 s dynamic, 2 s static (224x224 on one core: fixed after
# 60 guards 7.6 s, after 100 13.4 s: the cost per guard grows). The other models the project exports issue at most
# 51 on one dim (RAFT; HF decoders 1-3, diffusers UNets 13). Past this many guards on one input dim torch itself
# fixes that dim (its symbol_guard_limit_before_specialize), and the notes say which.
GUARDS_BEFORE_FIXED = 64


def _export_as_dynamic_as_possible(root: nn.Module, example_inputs: tuple, notes: list[str]):
    """(ExportedProgram, why its fixed dims are fixed): every dim Dim.AUTO, else the batch dim only, else none."""
    failures = []
    for dims, why in ((None, "the model fixes it"), ({0}, "dynamic export failed"), (set(), "dynamic export failed")):
        try:
            with symbolic_config.patch(symbol_guard_limit_before_specialize=GUARDS_BEFORE_FIXED):
                exported = torch.export.export(root, example_inputs,
                                               dynamic_shapes=_auto_dynamic(root, example_inputs, dims), strict=False)
        except Exception as error:  # noqa: BLE001 - some models only export with fewer dynamic dims
            if (not dims and dims is not None) or isinstance(error, GuardOnDataDependentSymNode):
                raise   # fewer dynamic dims cannot decide a branch on tensor values: each try cost a full export
            failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        if failures:
            kept = "only the batch dim (0) dynamic" if dims else "every input dim fixed"
            notes.append(f"{kept}: export with dynamic dims failed ({'; '.join(failures)})")
            why = f"{why}: {failures[0]}"
        costly = dims_fixed_for_cost(exported)
        if costly:
            notes.append(f"{', '.join(costly)} fixed: torch.export's shape reasoning on them passed "
                         f"{GUARDS_BEFORE_FIXED} guards each (minutes of capture); convert(..., dynamic_shapes=...) "
                         "keeps them dynamic, slowly")
            why = f"{why}, or its shape reasoning passed {GUARDS_BEFORE_FIXED} guards ({', '.join(costly)})"
        return exported, why


def dims_fixed_for_cost(exported) -> list[str]:
    """The input dims ("x.size()[2]") torch.export fixed because their shape reasoning passed GUARDS_BEFORE_FIXED."""
    values = (n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder")
    fake_mode = next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        return []
    over = [symbol for symbol, count in env.symbol_guard_counter.items() if count > GUARDS_BEFORE_FIXED]
    return sorted({re.sub(r"L\['([^']+)'\]", r"\1", source.name) for symbol in over
                   for source in env.var_to_sources.get(symbol, [])})


def _auto_dynamic(root: nn.Module, example_inputs: tuple, dims: set[int] | None = None):
    """Dim.AUTO for every dim (or only `dims`) of every example tensor, keyed by forward's argument names:
    torch.export matches a plain tuple against the signature, which `forward(self, *args)` fails."""
    auto = torch.export.Dim.AUTO
    specs = torch.utils._pytree.tree_map(
        lambda v: {i: auto for i in range(v.dim()) if dims is None or i in dims} if isinstance(v, torch.Tensor)
        else None, example_inputs)
    try:
        return dict(inspect.signature(root.forward).bind(*specs).arguments)
    except TypeError:   # torch.export will name the mismatch itself
        return specs


def _fixed_dims(graph: fx.Graph) -> dict[str, dict[int, int]]:
    """input name -> {dim: captured size} for the dims torch.export specialised."""
    fixed = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        dims = {i: int(s) for i, s in enumerate(value.shape) if is_concrete_int(s)}
        if dims:
            fixed[node.name] = dims
    return fixed


class FixedDimGuards(nn.Module):
    """torch.export's guards, after a check of the dims it fixed that names the input, dim and captured size
    (the guards alone raise `AssertionError: Guard failed: args_0.size()[0] == 2`)."""
    amp_canonical_op = "guards"
    _is_impure = True   # no users: dead-code elimination must keep it

    def __init__(self, guards: nn.Module, names: list[str], fixed: dict[str, dict[int, int]], why: str):
        super().__init__()
        self.guards, self.names, self.fixed, self.why = guards, names, fixed, why

    def forward(self, *inputs):
        for name, value in zip(self.names, inputs):
            for dim, size in self.fixed.get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] != size:
                    raise ValueError(
                        f"input {name} has size {value.shape[dim]} at dim {dim}, but the converted graph was captured "
                        f"with {size} there and that dim is fixed ({self.why}).\nConvert with an example of this "
                        "size, or give convert(..., dynamic_shapes=...) to keep it dynamic.")
        if torch.compiler.is_compiling():
            return self.guards(*inputs)
        try:
            return self.guards(*inputs)
        except AssertionError as error:
            raise ValueError(f"the inputs are outside what the converted graph was captured for: {error}") from None


def _guard_fixed_dims(root: nn.Module, graph: fx.Graph, fixed: dict, why: str) -> None:
    node = next((n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"), None)
    if node is None:
        return
    names = [arg.name if isinstance(arg, fx.Node) else None for arg in node.args]
    _set_attr(root, "_guards_fn", FixedDimGuards(root._guards_fn, names, fixed, why))


def _drop_dtype_assertions(graph: fx.Graph) -> None:
    """`.to(dtype)` in the model leaves `_assert_tensor_metadata(x, dtype=float32)` in the exported graph;
    mixed precision changes that dtype on purpose, so only the dtype check goes (device and layout stay)."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default):
        args = list(node.args)
        if len(args) > 3:
            args[3] = None
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}


@contextlib.contextmanager
def _custom_functions_recorded():
    """The user-defined autograd.Functions the model calls during export."""
    seen: set[str] = set()

    def record(cls, apply, args, kwargs):
        if not cls.__module__.startswith("torch."):
            seen.add(f"{cls.__module__}.{cls.__qualname__}")
        return apply(*args, **kwargs)

    with intercepted_function_apply(record):
        yield seen


class TrainingFlag(nn.Module):
    """Returns its own `training` flag, so an exported graph follows train()/eval() like the model."""
    amp_canonical_op = "training_flag"

    def forward(self) -> bool:
        return self.training


# ATen ops whose train flag torch.export bakes in as a constant: op -> argument index. For attention,
# the baked value is dropout_p (nn.MultiheadAttention passes 0.0 in eval mode).
_TRAIN_ARGS = {torch.ops.aten.dropout.default: 2, torch.ops.aten.batch_norm.default: 5,
               torch.ops.aten.feature_dropout.default: 2, torch.ops.aten.alpha_dropout.default: 2}
_DROPOUT_P_ARGS = {torch.ops.aten.scaled_dot_product_attention.default: 4}
_BATCH_NORM_RUNNING_MEAN = 3


def _follows_module_mode(node: fx.Node) -> bool:
    if node.target is torch.ops.aten.batch_norm.default:
        # No running statistics: batch statistics are always used (weight standardisation, or
        # track_running_stats=False); the flag is part of the computation, not the module's mode.
        return node.args[_BATCH_NORM_RUNNING_MEAN] is not None
    return node.target in _TRAIN_ARGS or len(node.args) > _DROPOUT_P_ARGS.get(node.target, 99)


def _make_training_flags_live(root: nn.Module, graph: fx.Graph) -> int:
    users = [n for n in graph.nodes if n.op == "call_function" and _follows_module_mode(n)]
    if not users:
        return 0
    root.add_module("amp_training_flag", TrainingFlag())
    with graph.inserting_before(users[0]):
        flag = graph.call_module("amp_training_flag")
    for node in users:
        args = list(node.args)
        if node.target in _TRAIN_ARGS:
            args[_TRAIN_ARGS[node.target]] = flag
        else:
            index = _DROPOUT_P_ARGS[node.target]
            with graph.inserting_before(node):
                args[index] = graph.call_function(dropout_p_when_training, (args[index], flag))
        node.args = tuple(args)
    return len(users)


_META = torch.device("meta")


def _devices_follow_parameters(root: nn.Module, graph: fx.Graph) -> int:
    """A model built on the meta device: torch.export wrote device='meta' into the graph (arange(..., device=meta));
    those arguments read the device of the first meta parameter instead. Returns how many nodes changed."""
    readers = [n for n in graph.nodes if n.op == "call_function" and _reads_meta_device(n)]
    anchor = next((n for n in graph.nodes if n.op == "get_attr" and
                   getattr(_attribute(root, n.target), "is_meta", False)), None)
    if not readers or anchor is None:
        return 0
    with graph.inserting_after(anchor):
        device = graph.call_function(getattr, (anchor, "device"))
    for node in readers:
        node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                                       lambda v: device if _is_meta(v) else v)
    return len(readers)


def _is_meta(value) -> bool:
    return isinstance(value, torch.device) and value == _META


def _reads_meta_device(node: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.append(v) if _is_meta(v) else None)
    return bool(found)


def _training_flags_note(live: int) -> str:
    return f"captured with torch.export; {live} dropout/batch-norm train flags follow train()/eval()"


def settle_training_flag(gm: fx.GraphModule, notes: list[str]) -> list[str]:
    """After a pass removed readers of the train flag (folded batch norms): the flag and its note as a capture of
    the edited model has them (no flag when nothing reads it, else it runs just before its first reader)."""
    flag = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == "amp_training_flag"), None)
    if flag is None:
        return notes
    live = len(flag.users)
    if live:
        next(n for n in gm.graph.nodes if n in flag.users).prepend(flag)
    else:
        gm.graph.erase_node(flag)
        gm.delete_submodule("amp_training_flag")
    gm.recompile()
    prefix, _, suffix = _training_flags_note(0).partition("0")
    return [_training_flags_note(live) if note.startswith(prefix) and note.endswith(suffix) else note
            for note in notes]


def export_failure(model, fx_error, export_error) -> TracingError:
    return TracingError(
        f"neither torch.fx nor torch.export could capture {type(model).__name__}.\n"
        f"  torch.fx: {type(fx_error).__name__}: {str(fx_error).splitlines()[0][:200]}{user_frame(fx_error)}\n"
        f"  torch.export: {type(export_error).__name__}: {str(export_error).splitlines()[0][:200]}"
        f"{user_frame(export_error)}\n"
        "Make the branch data-independent (torch.where / torch.cond) or convert the submodules "
        "that trace on their own.")


def _has_attr(module, target: str) -> bool:
    try:
        operator.attrgetter(target)(module)
    except AttributeError:
        return False
    return True


def _set_attr(module, target: str, value) -> None:
    *path, name = target.split(".")
    for part in path:
        module = getattr(module, part)
    if isinstance(value, (nn.Parameter, nn.Module)) or not isinstance(value, torch.Tensor):
        setattr(module, name, value)
    else:
        module.register_buffer(name, value, persistent=False)


def parameters_read_as_constants(graph_module: nn.Module, model: nn.Module) -> list[str]:
    """The model's trainable parameters that the graph reads as plain tensors (torch.export lifts a module
    reached through a plain attribute, `self.peer = sibling`, as constants): no gradient would reach them."""
    trainable = {_storage(p): name for name, p in model.named_parameters() if p.requires_grad}
    trainable.pop(None, None)   # meta tensors share no storage: nothing to compare them by
    constants = []
    for node in graph_module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attribute(graph_module, node.target)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and _storage(value) in trainable:
            constants.append(trainable[_storage(value)])
    return constants


def _attribute(module: nn.Module, target: str):
    for name in target.split("."):
        module = getattr(module, name, None)
    return module


def _storage(tensor: torch.Tensor):
    if tensor.is_meta:   # every meta tensor's data_ptr is 0
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - fake and meta tensors have no storage to share
        return None
