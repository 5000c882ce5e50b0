"""torch.fx symbolic trace that holds on real models: what fx cannot see into becomes one opaque node.

    submodule whose forward fx cannot trace       -> amp_opaque_call(self.<path>, ...)       (reported)
    function wrapped with torch.fx.wrap           -> traced into; opaque when that fails     (reported)
    custom torch.autograd.Function (or an alias of Fn.apply) -> amp_opaque_call(Fn.apply, ...): its own backward
    forward() returning an OrderedDict / namedtuple / ModelOutput -> the same type comes back
    forward(x, keep: int = 0, mask=None)       -> keep, mask baked in (Python values are constants; another
                                                  value at call time raises)
    submodule with a user hook (not a leaf)   -> amp_opaque_call(self.<path>, ...): its hooks fire (hooks.py)

Leaves are only modules whose precision is decided as one unit (Linear, ConvNd, norms, Embedding, RNNs,
Dropout), and only while they run their class's own forward: a subclass with its own forward
(timm's StdConv2d, NFNet's ScaledStdConv2d) is traced into, so its weight standardisation stays fp32.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from unittest import mock

import torch
import torch.fx as fx
import torch.fx._symbolic_trace as fx_trace
from torch.fx._symbolic_trace import _find_proxy
from torch import nn

from amp_compiler.frontend.errors import user_frame
from amp_compiler.frontend.function_apply import intercepted_function_apply, original_apply
from amp_compiler.frontend.hooks import hook_kinds, user_hooks_silenced
from amp_compiler.passes.fx.canonicalize import LEAF_MODULE_TYPES
from amp_compiler.passes.fx.opaque_calls import AS_WRITTEN
from amp_compiler.passes.fx.runtime import amp_opaque_call


def is_leaf_module(module: nn.Module) -> bool:
    if not isinstance(module, LEAF_MODULE_TYPES):
        return False
    own = module.__dict__.get("forward")
    if own is not None and not getattr(own, "_amp_installed_forward", False):   # `linear.forward = f`: traced into
        return False
    # torch.nn's own forward, not an override: the rules know what the leaf computes.
    owner = next(cls for cls in type(module).__mro__ if "forward" in cls.__dict__)
    return owner.__module__.startswith("torch.nn.")


class AmpTracer(fx.Tracer):
    # Buffers become get_attr nodes (not constants folded at trace time), so ops on them are painted
    # and in-place updates reach the real buffer.
    proxy_buffer_attributes = True

    def __init__(self):
        super().__init__()
        self.opaque: dict[str, str] = {}   # where -> why, for the report
        self.kept_for_hooks: set[str] = set()   # opaque only so that the user's hooks on them fire
        self.training_reads: list = []    # (module, flag): filled by training_reads_recorded around trace()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf_module(m)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def recording(*a, **k):  # the output's own structure, before fx turns dicts into immutable_dict
            out = fn(*a, **k)
            self.output_spec = torch.utils._pytree.tree_structure(out)
            return out
        return recording, args

    def trace(self, root, concrete_args=None):
        self._root_module = root
        self.output_spec = None
        # Global hooks would run on proxies inside every module traced into: they fire on calls instead.
        with _functions_traced_into(self), _autograd_functions_kept(self), _checkpoints_kept(self), \
                user_hooks_silenced():
            return super().trace(root, concrete_args)

    def call_module(self, m, forward, args, kwargs):
        if self.is_leaf_module(m, ""):
            return super().call_module(m, forward, args, kwargs)
        path = self.path_of_module(m)
        if path and hook_kinds(m):   # traced into, its hooks would run once, on proxies
            self.kept_for_hooks.add(path)
            why = f"has a user {' and '.join(hook_kinds(m))}: kept as one call so it fires"
            return self.opaque_call(path, path, why, args, kwargs)
        return self._try_or_opaque(lambda: super(AmpTracer, self).call_module(m, forward, args, kwargs),
                                   path, path, args, kwargs)

    def opaque_call(self, callee, where: str, why: str, args, kwargs):
        """One amp_opaque_call node; `callee` is a module path, or a callable stored on the root."""
        if not isinstance(callee, str):
            name = "amp_opaque_" + "".join(c if c.isalnum() else "_" for c in where)
            attr, index = name, 0
            while hasattr(self._root_module, attr) and getattr(self._root_module, attr) is not callee:
                index += 1
                attr = f"{name}_{index}"
            setattr(self._root_module, attr, callee)
            callee = attr
        getter = self.create_proxy("get_attr", callee, (), {})
        proxy = self.create_proxy("call_function", amp_opaque_call, (getter, AS_WRITTEN, *args), kwargs)
        proxy.node.meta["amp_opaque"] = why
        self.opaque[where] = why
        return proxy

    def _try_or_opaque(self, attempt, callee, where: str, args, kwargs):
        # fx makes `out.feature_maps`'s getattr node when it is first used: inside the attempt, it would be
        # erased with it and the opaque call would read a deleted node (self.decoder(self.encoder(x).maps))
        torch.fx.node.map_aggregate((args, kwargs), lambda a: a.node if isinstance(a, fx.Proxy) else a)
        last = self.graph._root.prev  # the newest node: everything after it belongs to this attempt
        reads, depth = len(self.training_reads), len(self.module_stack)
        try:
            return attempt()
        except Exception as error:  # noqa: BLE001 - any failure inside means: run this part as written
            _erase_after(self.graph, last)
            del self.training_reads[reads:]   # it runs as written: it follows train()/eval() itself
            while len(self.module_stack) > depth:   # fx pops a module's entry only when its call returns
                self.module_stack.popitem(last=True)
            why = f"torch.fx cannot trace it: {type(error).__name__}: {str(error).splitlines()[0][:120]}" \
                  f"{user_frame(error)}"
            return self.opaque_call(callee, where, why, args, kwargs)


def _erase_after(graph: fx.Graph, last: fx.Node) -> None:
    doomed = []
    node = last.next
    while node is not graph._root:
        doomed.append(node)
        node = node.next
    for node in reversed(doomed):
        graph.erase_node(node)


@contextlib.contextmanager
def _functions_traced_into(tracer: AmpTracer):
    """Functions registered with torch.fx.wrap are traced into (their matmuls and softmax get their own
    rules); one that cannot be traced runs as one opaque node."""
    table = fx_trace._wrapped_fns_to_patch
    saved = dict(table)
    patched = []
    for (_, name), frame in saved.items():
        if name not in frame:
            continue
        original = frame[name]

        @functools.wraps(original)   # fx records some calls as nodes (_assert_is_none): the op keeps its name
        def attempt(*args, _fn=original, _name=name, **kwargs):
            if _find_proxy(args, kwargs) is None:
                return _fn(*args, **kwargs)
            return tracer._try_or_opaque(lambda: _fn(*args, **kwargs), _fn, f"{_fn.__module__}.{_name}",
                                         args, kwargs)

        patched.append((frame, name, original))
        frame[name] = attempt
    table.clear()   # fx would otherwise patch them back to single nodes
    try:
        yield
    finally:
        table.update(saved)
        for frame, name, original in patched:
            frame[name] = original


def _autograd_functions_kept(tracer: AmpTracer):
    """A custom autograd.Function stays one node: fx would inline its forward and lose its backward."""
    def keep(cls, apply, args, kwargs):
        if _find_proxy(args, kwargs) is None:
            return apply(*args, **kwargs)
        why = f"custom autograd.Function {cls.__qualname__}: kept whole so its own backward runs"
        return tracer.opaque_call(original_apply(cls), f"{cls.__module__}.{cls.__qualname__}", why, args, kwargs)

    return intercepted_function_apply(keep)


def _checkpoints_kept(tracer: AmpTracer):
    """torch.utils.checkpoint of a submodule stays one opaque node, so it still recomputes in backward
    (traced into, its ops would be inlined: right gradients, no memory saved)."""
    checkpoint_module = torch.utils.checkpoint
    original = checkpoint_module.checkpoint

    def checkpoint(function, *args, **kwargs):
        module = getattr(function, "__self__", function)   # checkpoint(layer, x) or (layer.__call__, x)
        path = _module_path(tracer, module) if isinstance(module, nn.Module) else None
        if path is None or _find_proxy(args, kwargs) is None:
            return original(function, *args, **kwargs)
        callee = tracer.create_proxy("get_attr", path, (), {})
        why = "torch.utils.checkpoint: kept whole so it recomputes in backward"
        return tracer.opaque_call(original, f"checkpoint({path})", why, (callee, *args), kwargs)

    return mock.patch.object(checkpoint_module, "checkpoint", checkpoint)


def _module_path(tracer: AmpTracer, module: nn.Module) -> str | None:
    try:
        return tracer.path_of_module(module)
    except NameError:
        return None


def restore_output_type(graph: fx.Graph, spec) -> bool:
    """Return the model's own output container (OrderedDict, namedtuple, ModelOutput...) rather than
    the plain dict or tuple fx would generate. True when the graph now unflattens its outputs."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(output.args[0])
    if spec is None or spec.num_leaves != len(leaves) or \
            all(container in (tuple, list, dict) for container in _containers(spec)):
        return False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    in_spec = torch.utils._pytree.tree_structure((tuple(range(len(placeholders))), {}))
    names = [n.target for n in placeholders]
    graph._codegen = _OwnOutputCodeGen(fx.graph._PyTreeInfo(names, in_spec, spec))
    output.args = (tuple(leaves),)
    return True


def keep_output_type_when_saved(gm: fx.GraphModule) -> None:
    """torch.save / torch.load of `gm` returns the model's own container too (its class is gm's alone: fx gives
    every GraphModule a class of its own)."""
    if isinstance(gm.graph._codegen, _OwnOutputCodeGen):
        type(gm).__reduce__ = saved_with_output_type


def saved_with_output_type(gm: fx.GraphModule) -> tuple:
    """fx's __reduce__, and, when gm returns its model's own container, that container restored once loaded: fx
    rebuilds a loaded GraphModule by tracing its saved code, which turns a ModelOutput into a plain dict."""
    rebuild, arguments = fx.GraphModule.__reduce__(gm)
    if not isinstance(gm.graph._codegen, _OwnOutputCodeGen):
        return rebuild, arguments
    return _loaded_with_output_type, (rebuild, arguments, gm.graph._codegen.pytree_info.out_spec)


def _loaded_with_output_type(rebuild, arguments, spec) -> fx.GraphModule:
    gm = rebuild(*arguments)
    if restore_output_type(gm.graph, spec):
        gm.recompile()
        keep_output_type_when_saved(gm)   # saved again, it keeps it again
    return gm


class _OwnOutputCodeGen(fx.graph._PyTreeCodeGen):
    """Unflattens the outputs into the model's container; the inputs are the forward's own, defaults kept.
    fx's pytree codegen writes a forward with defaults as `x, mask = None, = tree_flatten_spec(...)`: a
    SyntaxError at recompile."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def=False):
        return fx.graph.CodeGen.gen_fn_def(self, free_vars, maybe_return_annotation, expanded_def=expanded_def)

    def process_inputs(self, *inputs):
        return fx.graph.CodeGen.process_inputs(self, *inputs)


def _containers(spec):
    if spec.is_leaf():
        return
    yield spec.type
    for child in spec.children():
        yield from _containers(child)


BAKED_TYPES = (type(None), bool, int, float, str)


def baked_arguments(root: nn.Module, example_inputs) -> dict:
    """forward() arguments that are Python values, not tensors: the example input where given, else the
    default. They are constants of the graph (as torch.export makes them): as placeholders they would reach
    `if mask is None`, `isinstance(logits_to_keep, int)` or a slice as Proxies and trace the wrong branch (an
    HF causal LM's logits came out (2, 1000) for (2, 32, 1000)). A call with another value raises
    (baked_in_place)."""
    given = example_inputs or ()
    baked = {}
    for index, (name, param) in enumerate(inspect.signature(root.forward).parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = given[index] if index < len(given) else param.default
        if isinstance(value, BAKED_TYPES):
            baked[name] = value
    return baked


def baked_in_place(graph: fx.Graph, baked: dict, model_name: str) -> None:
    """The placeholders of baked arguments keep the parameter's name (fx calls them `mask_1`, so a call
    passing `mask=` by keyword was a TypeError), and fx's checks of their value say what to do."""
    for node in graph.nodes:
        if node.op == "placeholder" and node.target.endswith("_1") and node.target[:-2] in baked:
            node.target = node.target[:-2]
        elif node.op == "call_function" and len(node.args) == 2 and isinstance(node.args[1], str):
            name = node.args[1].split(" has been specialized to have value ")[0]
            if name in baked and node.args[1].startswith(name + " has been specialized"):
                node.args = (node.args[0], f"{model_name} was converted with {name}={baked[name]!r} baked in (a "
                             "Python value, not a tensor, is a constant of the graph) and this call passes another "
                             f"{name}: convert again with that value in example_inputs, or convert(..., "
                             "inplace=True), which captures a graph per value")
