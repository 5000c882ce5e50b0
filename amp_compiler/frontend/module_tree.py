"""The converted GraphModule shares the user's tensors but never the user's module objects.

share_module_tree makes a shallow copy of the module tree (the parameter and buffer tensors are the
originals), so train()/eval(), added submodules or hooks on the result never reach the user's model.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.fx as fx
from torch import nn


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """A torch.compile'd model forwards attribute writes to the module it wraps: convert that module."""
    compiled = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    if isinstance(model, compiled):
        return model._orig_mod, ["the model was torch.compile'd: its original module (_orig_mod) was converted; "
                                 "compile the converted GraphModule again if you want both"]
    return model, []


_PLAIN_CONTAINERS = (dict, OrderedDict, set)


def share_module_tree(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original's tensors."""
    # object.__new__ rather than copy.copy: parametrized modules (weight_norm, spectral_norm) refuse
    # __getstate__, and the copy needs nothing but the instance dict.
    clone = object.__new__(type(module))
    # Containers (parameter/buffer/hook dicts, the non-persistent buffer set, a forward's own dicts) are
    # copied so nothing done to the clone, tracing included, reaches the user's module; the tensors inside
    # are shared.
    clone.__dict__.update({name: _container_copy(value) for name, value in module.__dict__.items()
                           if not getattr(value, "_amp_installed_forward", False)   # an in-place conversion's forward
                           and name != "_amp_compiled"})                             # and its record
    clone._modules = {name: share_module_tree(child) if child is not None else None
                      for name, child in module._modules.items()}
    return clone


def _container_copy(value):
    if type(value) in _PLAIN_CONTAINERS:
        return value.copy()
    if isinstance(value, (dict, set)):
        # A subclass's .copy() can lose what its class keeps beside the items (diffusers' FrozenDict config
        # answers `config.center_input_sample` from attributes); copy.copy keeps class and attributes. One
        # that refuses to be copied (FrozenDict refuses item assignment) is immutable: shared.
        try:
            return copy.copy(value)
        except Exception:  # noqa: BLE001 - an uncopyable container is shared like any other value
            return value
    return value


def _code_not_generated_yet(*args, **kwargs):
    raise RuntimeError("this GraphModule's code is generated once its passes are done (run_pipeline recompiles)")


def _graph_that_raises() -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.call_function(_code_not_generated_yet))
    return graph


def graph_module_on(root: nn.Module, graph: fx.Graph, class_name: str, *, generate_code: bool = True) -> fx.GraphModule:
    """A GraphModule that holds `root`'s own submodules, parameters and buffers (all of them).
    generate_code=False: the Python code is not generated (a tenth of a second per thousand nodes); calling the
    module raises until gm.recompile() (the caller's passes edit the graph and recompile once, at the end)."""
    if not generate_code:
        gm = fx.GraphModule(root, _graph_that_raises(), class_name=class_name)
        for node in graph.nodes:   # what fx.GraphModule copies from root: get_attr / call_module targets
            if node.op in ("get_attr", "call_module"):
                fx.graph_module._copy_attr(root, gm, node.target)
        gm._graph, graph.owning_module = graph, gm
        if graph._tracer_cls and "<locals>" not in graph._tracer_cls.__qualname__:
            gm._tracer_cls = graph._tracer_cls
        gm._tracer_extras = graph._tracer_extras or {}
        return _with_root_tensors(gm, root)
    return _with_root_tensors(fx.GraphModule(root, graph, class_name=class_name), root)


def code_on_first_use(gm: fx.GraphModule) -> fx.GraphModule:
    """Generate gm's Python code when it is first called, printed or read (gm.code), not now: convert() compiles a
    copy of a capture (graph_module_to_compile) and never needs the capture's own code."""
    cls = type(gm)   # fx gives every GraphModule a class of its own: this changes `gm` alone

    def generate(self) -> None:
        for name in ("forward", "code", "__str__"):
            if getattr(getattr(cls.__dict__.get(name), "fget", cls.__dict__.get(name)), "_amp_lazy", False):
                delattr(cls, name)
        self.recompile()

    def forward(self, *args, **kwargs):
        generate(self)
        return self.forward(*args, **kwargs)

    def code(self) -> str:
        generate(self)
        return self._code

    def text(self) -> str:
        generate(self)
        return str(self)

    for name, function in (("forward", forward), ("code", code), ("__str__", text)):
        function._amp_lazy = True
        setattr(cls, name, property(function) if name == "code" else function)
    return gm


def _with_root_tensors(gm: fx.GraphModule, root: nn.Module) -> fx.GraphModule:
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
