"""Front end: turn a user's nn.Module into an fx GraphModule the passes can rewrite.

    model --fx symbolic trace (into composite modules)--> GraphModule
          --on failure, with example_inputs: torch.export--> GraphModule of ATen ops
Leaves are only modules whose precision is decided as one unit (Linear, ConvNd, norms, Embedding,
RNNs, Dropout for its train/eval flag). The GraphModule shares the model's parameters and buffers
through a shallow copy of the module tree, so train()/eval() on it never flips the user's modules and
state_dict() keys are the original's.
"""
from __future__ import annotations

import copy
import inspect
import operator
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from passes.canonicalize import LEAF_MODULE_TYPES
from passes.graph_leaf import graph_leaf


class TracingError(RuntimeError):
    """Neither torch.fx nor torch.export could capture the model."""


@dataclass
class TracedModel:
    graph_module: fx.GraphModule
    frontend: str                       # "fx.symbolic_trace" | "torch.export"
    leaves: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class AmpTracer(fx.Tracer):
    # Buffers become get_attr nodes (not constants folded at trace time), so ops on them are painted
    # and in-place updates reach the real buffer.
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULE_TYPES)


def share_module_tree(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original's tensors."""
    clone = copy.copy(module)
    # Containers (parameter/buffer/hook dicts, the non-persistent buffer set) are copied so nothing done
    # to the clone reaches the user's module; the tensors inside are shared.
    clone.__dict__ = {name: copy.copy(value) if isinstance(value, (dict, set)) else value
                      for name, value in module.__dict__.items()}
    clone._modules = {name: share_module_tree(child) if child is not None else None
                      for name, child in module._modules.items()}
    return clone


def graph_module_on(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """A GraphModule that holds `root`'s own submodules, parameters and buffers (all of them)."""
    gm = fx.GraphModule(root, graph, class_name=class_name)
    for name, child in root._modules.items():
        gm._modules[name] = child
    for name, param in root._parameters.items():
        gm._parameters[name] = param
    for name, buffer in root._buffers.items():
        gm._buffers[name] = buffer
        if name in root._non_persistent_buffers_set:
            gm._non_persistent_buffers_set.add(name)
    gm.train(root.training)
    return gm


def trace(model: nn.Module, example_inputs=None) -> TracedModel:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() needs a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, "
                        f"got {type(example_inputs).__name__}")
    root = share_module_tree(model)
    tracer = AmpTracer()
    concrete = _optional_arguments(root, example_inputs)
    try:
        graph = tracer.trace(root, concrete_args=concrete or None)
    except Exception as fx_error:  # noqa: BLE001 - any fx failure means: try the next front end
        return _export_fallback(model, root, example_inputs, fx_error)
    for node in graph.nodes:
        # fx records `x: torch.Tensor` annotations as a string global that torch.save cannot pickle
        # (the plain symbolic_trace GraphModule fails the same way); they change nothing at run time.
        if node.op in ("placeholder", "output"):
            node.type = None
    gm = graph_module_on(root, graph, type(model).__name__ + "Amp")
    leaves = sorted({n.target for n in graph.nodes if n.op == "call_module"})
    notes = [f"traced with {name}={value!r}; calls that pass another value raise (give it in example_inputs "
             "to trace it as an input)" for name, value in concrete.items()]
    return TracedModel(gm, "fx.symbolic_trace", leaves, notes)


def _optional_arguments(root: nn.Module, example_inputs) -> dict:
    """forward() arguments defaulting to None or a bool that example_inputs do not cover: they usually
    pick a branch (`if mask is None`), which fx would otherwise trace the wrong way."""
    covered = len(example_inputs) if example_inputs is not None else 0
    concrete = {}
    for index, (name, param) in enumerate(inspect.signature(root.forward).parameters.items()):
        if index >= covered and (param.default is None or isinstance(param.default, bool)):
            concrete[name] = param.default
    return concrete


def _export_fallback(model, root, example_inputs, fx_error) -> TracedModel:
    where = _user_frame(fx_error)
    if example_inputs is None:
        raise TracingError(
            f"torch.fx could not trace {type(model).__name__}: {type(fx_error).__name__}: {fx_error}"
            f"{where}. This is usually Python control flow on tensor shapes or values. Pass "
            "example_inputs=(x, ...) so convert() can fall back to torch.export, or rewrite that "
            "branch with torch.where / torch.cond.") from fx_error
    try:
        exported = torch.export.export(root, example_inputs, strict=False)
    except Exception as export_error:  # noqa: BLE001
        raise TracingError(
            f"neither torch.fx nor torch.export could capture {type(model).__name__}.\n"
            f"  torch.fx: {type(fx_error).__name__}: {fx_error}{where}\n"
            f"  torch.export: {type(export_error).__name__}: {str(export_error).splitlines()[0]}"
            f"{_user_frame(export_error)}\n"
            "Make the branch data-independent (torch.where / torch.cond) or convert the submodules "
            "that trace on their own.") from export_error
    unlifted = exported.module()
    graph = fx.Graph()
    values: dict = {}
    for node in unlifted.graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":
            continue
        if node.op == "output":  # restore the model's own output structure (export flattens it)
            flat = list(fx.node.map_arg(node.args[0], lambda n: values[n]))
            graph.output(torch.utils._pytree.tree_unflatten(flat, unlifted._out_spec))
            continue
        values[node] = graph.node_copy(node, lambda n: values[n])
    for node in graph.nodes:  # constants torch.export lifted out of the code live on `unlifted`
        if node.op == "get_attr" and not _has_attr(root, node.target):
            _set_attr(root, node.target, operator.attrgetter(node.target)(unlifted))
    live = _make_training_flags_live(root, graph)
    gm = graph_module_on(root, graph, type(model).__name__ + "Amp")
    notes = ["torch.fx could not trace the model (" + f"{type(fx_error).__name__}: {fx_error}"[:160] +
             f"); captured with torch.export ({live} dropout/batch-norm train flags follow train()/eval())"]
    return TracedModel(gm, "torch.export", [], notes)


class TrainingFlag(nn.Module):
    """Returns its own `training` flag, so an exported graph follows train()/eval() like the model."""

    def forward(self) -> bool:
        return self.training


@graph_leaf
def dropout_p_when_training(p: float, training: bool) -> float:
    return p if training else 0.0


# ATen ops whose train flag torch.export bakes in as a constant: op -> argument index. For attention,
# the baked value is dropout_p (nn.MultiheadAttention passes 0.0 in eval mode).
_TRAIN_ARGS = {torch.ops.aten.dropout.default: 2, torch.ops.aten.batch_norm.default: 5,
               torch.ops.aten.feature_dropout.default: 2, torch.ops.aten.alpha_dropout.default: 2}
_DROPOUT_P_ARGS = {torch.ops.aten.scaled_dot_product_attention.default: 4}


def _make_training_flags_live(root: nn.Module, graph: fx.Graph) -> int:
    users = [n for n in graph.nodes if n.op == "call_function" and (
        n.target in _TRAIN_ARGS or len(n.args) > _DROPOUT_P_ARGS.get(n.target, 99))]
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


def _user_frame(error: BaseException) -> str:
    """' (at file:line: code)': the deepest frame of model code (the user's or torch.nn's), the construct
    that broke tracing; tracer internals and this package are skipped."""
    torch_dir = os.path.dirname(torch.__file__)
    internals = tuple(os.path.join(torch_dir, d) for d in ("fx", "_", "export", "utils", "overrides.py",
                                                           "_tensor.py", "_ops.py"))
    own_dir = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(internals) and not f.filename.startswith(own_dir)]
    if not frames:
        frames = traceback.extract_tb(error.__traceback__)[-1:]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno}: {frame.line})"


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
    if isinstance(value, nn.Parameter) or not isinstance(value, torch.Tensor):
        setattr(module, name, value)
    else:
        module.register_buffer(name, value, persistent=False)
