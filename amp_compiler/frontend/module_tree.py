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
                           if not getattr(value, "_amp_part_forward", False)})   # in-place conversion's forward
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
