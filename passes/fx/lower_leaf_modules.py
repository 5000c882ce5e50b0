"""Expose the parameters of low-precision leaf modules, so their casts are graph nodes.

    fc = self.fc(x)        ->   fc = torch.nn.functional.linear(x, self.fc.weight, self.fc.bias)
    conv = self.conv(x)    ->   conv = torch.conv2d(x, self.conv.weight, self.conv.bias, stride, ...)
    lstm = self.lstm(x)    ->   lstm = amp_module_call(self.lstm, torch.float16, x)

The parameters are read with get_attr, so insert_casts casts them where they are read, once per
forward, and the fp32 parameters stay the masters. Norm modules keep calling the module: PyTorch's norm
kernels take low-precision input with fp32 weights and keep fp32 statistics. Only nodes painted "low" change.
A module with a user hook (front end: facts "hooks") stays a call to the module, through amp_module_call, so
its hooks fire with the module's inputs and outputs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.passes.fx.runtime import amp_module_call
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts

_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}
MIXED_KERNEL_MODULES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                        nn.modules.instancenorm._InstanceNorm, nn.RMSNorm, nn.modules.dropout._DropoutNd,
                        nn.Identity)


def _functional_call(module: nn.Module, node: fx.Node):
    """(function, extra positional args) for modules with a plain functional form, else None."""
    if type(module) is nn.Linear:
        return F.linear, ()
    if type(module) in _CONV and module.padding_mode == "zeros":
        return _CONV[type(module)], (module.stride, module.padding, module.dilation, module.groups)
    if type(module) in _CONV_T and not node.kwargs and len(node.args) == 1:
        return _CONV_T[type(module)], (module.stride, module.padding, module.output_padding,
                                       module.groups, module.dilation)
    return None


def _attribute(gm: fx.GraphModule, target: str):
    return operator.attrgetter(target)(gm)


def lower_leaf_modules(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    graph, changed = gm.graph, 0
    # One get_attr per tensor, so a module called twice, or a weight tied to another (an embedding and its
    # output layer, shared blocks under two names), is cast once per forward.
    getters = {id(_attribute(gm, n.target)): n for n in graph.nodes if n.op == "get_attr"}
    seen: set[fx.Node] = set()   # nodes before the reader being lowered

    def getter(target: str, reader: fx.Node) -> fx.Node:  # called at the reader's insertion point
        key = id(_attribute(gm, target))
        if key not in getters:
            getters[key] = graph.get_attr(target)
            getters[key].meta["amp"] = {"op": "get_attr", "class": "io", "precision": None, "rule": "parameter"}
        elif getters[key] not in seen:   # the traced get_attr of a tied weight comes later: read it here
            reader.prepend(getters[key])
        seen.add(getters[key])
        return getters[key]

    for node in list(graph.nodes):
        seen.add(node)
        if node.op != "call_module" or facts(node).get("precision") != "low":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, MIXED_KERNEL_MODULES) or not any(True for _ in module.parameters()):
            continue
        functional = None if facts(node).get("hooks") else _functional_call(module, node)
        with graph.inserting_before(node):
            if functional is not None:
                fn, extra = functional
                weight = getter(f"{node.target}.weight", node)
                bias = getter(f"{node.target}.bias", node) if module.bias is not None else None
                new = graph.call_function(fn, (node.args[0], weight, bias, *extra))
            else:
                new = graph.call_function(amp_module_call, (getter(node.target, node), low, *node.args),
                                          dict(node.kwargs))
        new.meta = node.meta
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed += 1
    return PassResult(modified=changed > 0, counts={"leaf_modules_lowered": changed})

