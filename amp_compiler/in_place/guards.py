"""What a part's capture baked in besides its tensor inputs, and what a graph cannot do that the forward did.

    ModuleState(part.module)   the part's modules' plain attributes (self.step, self.scale = tensor, dropout's
                               p), their children and their hooks, as the capture saw them: a graph runs only
                               while they still are (else the part captures again, within CAPTURE_LIMIT)
    assigned_attributes(...)   a forward that assigns self.x: the graph would not (the user's module never
                               sees it): the part runs as written
    grad_mode_changes()        a forward that enters no_grad / enable_grad / inference_mode: fx records tensor
                               ops only, the graph would compute gradients the forward switched off
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from amp_compiler.frontend.hooks import HOOK_DICTS
from amp_compiler.in_place.part import PartForward

_NOT_BAKED = ("training", "forward")   # flags are watched apart (Graph.watched); forward is the part's own
_CONSTANTS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MISSING = object()
# objects whose own attributes are not settings a forward reads (modules are walked themselves)
_NOT_SETTINGS = (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                 functools.partial)


def _plain_attributes(module: nn.Module):
    """The public instance attributes a forward reads as Python values (private ones are torch's own)."""
    return [(name, value) for name, value in module.__dict__.items()
            if not name.startswith("_") and name not in _NOT_BAKED]


def _constant(value) -> bool:
    return type(value) in _CONSTANTS or (type(value) in (tuple, frozenset) and all(_constant(v) for v in value))


def _same(now, then) -> bool:
    # equal constants count as the same (torch.compile rebuilds tuples such as LayerNorm's normalized_shape)
    return now is then or (type(now) is type(then) and _constant(then) and now == then)


class ModuleState:
    """The attributes, children and hooks of a part's modules when it was captured; holds() says they still are."""
    __slots__ = ("values", "contents", "forwards", "sizes", "attribute_counts", "hook_keys")

    def __init__(self, part_module: nn.Module):
        self.values: list = []      # (container, name, value the capture saw)
        self.contents: list = []    # (container, name, items): a list or dict of constants changed in place
        self.forwards: list = []    # (child's instance dict, the forward put there): `child.forward = ...` since
        self.sizes: list = []       # (container, length): a child or hook added since
        self.attribute_counts: list = []   # [instance dict, its length, public attributes]: one added since
        self.hook_keys: list = []   # (hook dict, its handles): a hook swapped for another
        settings_seen: set = set()
        for module in part_module.modules():
            self._add(module.__dict__, _plain_attributes(module), all_values=True)
            for settings in _settings_objects(module, settings_seen):
                self._add(settings, settings.items(), all_values=False)
            self.values += [(module._modules, name, child) for name, child in module._modules.items()]
            self.sizes.append((module._modules, len(module._modules)))
            self.attribute_counts.append([module.__dict__, len(module.__dict__), len(_plain_attributes(module))])
            if module is part_module:   # the part's own hooks fire around its call, graph or not
                continue
            self.forwards.append((module.__dict__, _instance_forward(module.__dict__)))
            for name in HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks is not None:
                    self.sizes.append((hooks, len(hooks)))
                    if hooks:
                        self.hook_keys.append((hooks, tuple(hooks)))

    def _add(self, container: dict, items, all_values: bool) -> None:
        """Constants and lists/dicts of constants by value; other objects (when all_values) by identity."""
        for name, value in items:
            items_now = _constant_items(value)
            if items_now is not None:
                self.contents.append((container, name, items_now))
            elif all_values or value is None or _constant(value):
                self.values.append((container, name, value))

    def holds(self) -> bool:
        return (all(len(container) == size for container, size in self.sizes)
                and all(len(counts[0]) == counts[1] or _same_public_count(counts) for counts in self.attribute_counts)
                and all(_same(container.get(name, _MISSING), value) for container, name, value in self.values)
                and all(_constant_items(container.get(name)) == items for container, name, items in self.contents)
                and all(_instance_forward(attributes) is forward for attributes, forward in self.forwards)
                and all(tuple(hooks) == keys for hooks, keys in self.hook_keys))


def _constant_items(value):
    """A list's items or a dict's (key, value) pairs as a tuple when they are all constants, else None."""
    if type(value) is list:
        items = tuple(value)
    elif type(value) is dict:
        items = tuple(value.items())
    else:
        return None
    return items if _constant(items) else None


def _instance_forward(attributes: dict):
    # the in-place conversion's own forward (the child became a part) is the class's forward, as traced
    forward = attributes.get("forward", _MISSING)
    return _MISSING if isinstance(forward, PartForward) else forward


def _same_public_count(counts: list) -> bool:
    """A private attribute added since (torch.compile marks modules, Accelerate puts its hook there) changes
    nothing a forward reads: the new length is the one compared from then on."""
    attributes, _, public = counts
    if sum(1 for name in attributes if not name.startswith("_") and name not in _NOT_BAKED) != public:
        return False
    counts[1] = len(attributes)
    return True


def _settings_objects(module: nn.Module, seen: set) -> list[dict]:
    """The instance dicts of objects the module holds (a Hugging Face config: `model.config.output_hidden_states
    = True` after the capture must reach the forward that reads it), each object once."""
    found = []
    for _, value in _plain_attributes(module):
        if id(value) in seen or isinstance(value, _NOT_SETTINGS) or type(value) in _CONSTANTS:
            continue
        attributes = getattr(value, "__dict__", None)
        if type(attributes) is dict:
            seen.add(id(value))
            found.append(attributes)
    return found


# what nn.Module keeps in every instance dict (hook and tensor dicts: the capture's copy has its own)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"forward"}


def assigned_attributes(traced: nn.Module, part_module: nn.Module) -> list[str]:
    """`self.x = ...` (private names too) the forward did while traced (on the capture's copy `traced` of `part_module`'s tree)."""
    originals = dict(part_module.named_modules(remove_duplicate=False))
    assigned = []
    for path, copy in traced.named_modules(remove_duplicate=False):
        original = originals.get(path)
        if original is None:
            continue
        before = original.__dict__
        assigned += [f"{path}.{name}" if path else name for name, value in copy.__dict__.items()
                     if name not in _MODULE_INTERNALS and not _same_or_copied(value, before.get(name, _MISSING))]
    return assigned


def _same_or_copied(value, original) -> bool:
    if _same(value, original):
        return True
    if not isinstance(value, (dict, set)) or type(value) is not type(original):
        return False
    try:   # share_module_tree gave the copy its own dicts and sets (their items are the same objects)
        return bool(value == original)
    except Exception:  # noqa: BLE001 - items that cannot be compared (tensors put there): changed
        return False


@contextlib.contextmanager
def grad_mode_changes():
    """Yields a list that gets each grad-mode switch (no_grad, enable_grad, set_grad_enabled, inference_mode)
    made while torch.fx traces (torch.export, which records them itself, is not counted)."""
    changes: list[str] = []
    set_grad_enabled, inference_mode = torch._C._set_grad_enabled, torch._C._InferenceMode

    def recording_set_grad_enabled(mode):
        if is_fx_symbolic_tracing():   # a switch to the mode the capture runs in counts too: a call may not
            changes.append("torch.enable_grad()" if mode else "torch.no_grad()")
        return set_grad_enabled(mode)

    def recording_inference_mode(mode=True):
        if is_fx_symbolic_tracing() and mode:
            changes.append("torch.inference_mode()")
        return inference_mode(mode)

    torch._C._set_grad_enabled, torch._C._InferenceMode = recording_set_grad_enabled, recording_inference_mode
    try:
        yield changes
    finally:
        torch._C._set_grad_enabled, torch._C._InferenceMode = set_grad_enabled, inference_mode
