"""Capture once per repeated block: a part structurally identical to one already captured reuses its graph.

    signature(part, args, kwargs, tensors)   what a capture of the part depends on besides tensor values: the
                                             module tree (paths, types, flags), each parameter's and buffer's
                                             name/shape/dtype/requires_grad/device, the plain attributes' values
                                             (other objects by identity), the call key and the input shapes;
                                             None when the part has hooks or its own instance forward
    template_of(gm, part)                    the compiled graph as a Template, or None when the graph could hold
                                             something of this block's own (a constant on the GraphModule, a
                                             module or tensor in a node's arguments, a module a pass added)
    template.bind(wrapper)                   a GraphModule running the template's graph code and decisions on
                                             another part's own module tree (its own parameters and buffers)

An LLM's decoder layers hold identical q/k/v/o projections and MLPs: one capture each, the other layers reuse
it. Modules whose attributes differ (a layer_idx, a Dropout's p, a width) have other signatures: captured apart.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.frontend.capture import _copied   # one level of dicts/lists copied: each graph edits its own
from amp_compiler.frontend.hooks import HOOK_DICTS
from amp_compiler.frontend.module_tree import graph_module_on
from amp_compiler.in_place.call_key import call_key
from amp_compiler.in_place.guards import _NOT_SETTINGS
from amp_compiler.saved_decisions import SAVED_ATTRIBUTE, preserve_decisions

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
# what a GraphModule holds of its own besides its graph code (anything else a pass put there: not reusable)
_GRAPH_MODULE_OWN = frozenset(fx.GraphModule(nn.Module(), fx.Graph()).__dict__) | {SAVED_ATTRIBUTE}
_INERT = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout,
          type(Ellipsis))


class _Same:
    """An attribute that is not a constant: equal only to the very same object (a config shared by all layers)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value   # held: its id cannot be given to another object while the template lives

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self):
        return id(self.value)


def _typed(value, settings: bool = True):
    """A constant as a hashable key that tells True from 1 and -0.0 from 0.0; other objects by identity, and
    an object holding settings (a Hugging Face config) with its attributes' values as well, as ModuleState
    guards them: a config changed since the template's capture makes another signature."""
    kind = type(value)
    if kind in (float, complex):
        return kind, repr(value)
    if kind in _INERT:
        return kind, value
    if kind in (tuple, list):
        return kind, tuple(_typed(item, settings) for item in value)
    if kind is dict:
        return kind, tuple((_typed(k, False), _typed(v, settings)) for k, v in value.items())
    attributes = getattr(value, "__dict__", None) if settings and not isinstance(value, _NOT_SETTINGS) else None
    if type(attributes) is dict:
        return _Same(value), tuple((name, _typed(item, False)) for name, item in attributes.items())
    return _Same(value)


def _tensor_facts(tensor):
    if tensor is None:
        return None
    return type(tensor), tuple(tensor.shape), tensor.dtype, tensor.requires_grad, tensor.device


def _module_facts(module: nn.Module, is_part: bool):
    """One module's share of the signature, or None when it has hooks (they could differ between blocks)."""
    if any(module.__dict__.get(name) for name in HOOK_DICTS):
        return None
    attributes = []
    for name, value in module.__dict__.items():
        if name in _MODULE_INTERNALS:
            continue
        if name == "forward" and (is_part or getattr(value, "_amp_part_forward", False)):
            continue   # the part's own forward (captures run the class's) or a child part's: the class's is traced
        attributes.append((name, _typed(value)))
    return (type(module), module.training, tuple((name, child is None) for name, child in module._modules.items()),
            tuple((name, _tensor_facts(p)) for name, p in module._parameters.items()),
            tuple((name, _tensor_facts(b)) for name, b in module._buffers.items()), tuple(attributes))


def signature(part, args: tuple, kwargs: dict, tensors: list):
    """What the part's capture would depend on, as a hashable key; None: the part is captured on its own."""
    if part.own_forward is not None:
        return None
    facts = [call_key(args, kwargs)[0], tuple((tuple(t.shape), t.requires_grad) for t in tensors)]
    for path, module in part.module.named_modules(remove_duplicate=False):
        module_facts = _module_facts(module, module is part.module)
        if module_facts is None:
            return None
        facts.append((path, module_facts))
    return tuple(facts)


@dataclass
class Template:
    graph: fx.Graph        # the compiled graph (before any freeze: frozen copies are made per graph)
    meta: dict             # gm.meta as compile_graph left it
    part_path: str         # the part it was captured on (explain: reused_from)
    class_name: str

    def bind(self, wrapper: nn.Module) -> fx.GraphModule | None:
        """The template's graph code and decisions on `wrapper` (BoundCall on another part's own module tree);
        None when the graph does not fit that tree (the part is captured itself)."""
        try:
            gm = graph_module_on(wrapper, _graph_copy(self.graph), self.class_name)   # wrapper's own modules
        except Exception:  # noqa: BLE001 - a target the tree lacks: capturing it is the safe answer
            return None
        gm.meta.update({name: _copied(value) for name, value in self.meta.items()})
        gm.meta["amp"]["reused_from"] = self.part_path
        preserve_decisions(gm)
        return gm


def template_of(gm: fx.GraphModule, part) -> Template | None:
    """A Template of a freshly compiled part graph when the graph holds nothing of its block's own."""
    amp = gm.meta.get("amp", {})
    if amp.get("frontend") != "fx.symbolic_trace" or set(gm._modules) != {"inner"} or gm._parameters or \
            gm._buffers or not set(gm.__dict__) <= _GRAPH_MODULE_OWN:
        return None
    if any(not path.startswith("inner") for path in amp.get("training_reads", {})):
        return None
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module") and not node.target.startswith("inner."):
            return None
        if node.op == "call_function" and not _inert_callee(node.target):
            return None
        if not all(_inert(leaf) for leaf in _leaves((node.args, node.kwargs))):
            return None
    if _tree(gm._modules["inner"]) != _tree(part.module):   # a pass added or swapped a module
        return None
    meta = {name: _copied(value) for name, value in gm.meta.items()}   # the part's own edits stay its own
    return Template(_graph_copy(gm.graph), meta, part.path, type(gm).__name__)


def _tree(module: nn.Module) -> list:
    return [(path, type(m)) for path, m in module.named_modules(remove_duplicate=False)]


def _leaves(value):
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, slice):
        yield from _leaves((value.start, value.stop, value.step))
    else:
        yield value


def _inert(leaf) -> bool:
    """A node argument that cannot belong to one block: another node or a plain constant (never a tensor or module)."""
    return isinstance(leaf, fx.Node) or type(leaf) in _INERT


def _inert_callee(target) -> bool:
    if isinstance(target, functools.partial):
        return False
    owner = getattr(target, "__self__", None)
    return not isinstance(owner, (nn.Module, torch.Tensor))


def _graph_copy(graph: fx.Graph) -> fx.Graph:
    """As graph_module_to_compile copies a capture's graph: same node names and code, each node's meta its own."""
    copied = copy.deepcopy(graph)
    for node in copied.nodes:
        node.meta = {name: _copied(value) for name, value in node.meta.items()}
    return copied


class Templates(dict):
    """signature -> Template; torch.save / deepcopy of the model keep none (the copy captures again)."""

    def __reduce__(self):
        return Templates, ()
