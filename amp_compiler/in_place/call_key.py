"""What a part's capture assumed about a call, as a dict key: one dict lookup per call finds its graph.

    call_key((x,), {"mask": m, "use_cache": False})
      -> key   ((float32, 2, "cpu"), "mask", (float32, 4, "cpu"), "use_cache", (bool, False))
      -> tensors [x, m]                        (the graph's inputs, in order)
Tensors count by dtype, rank and device type (the capture is shape-generic); None, bools,
numbers, strings, dtypes and devices are baked into the graph, so each value is a key of its own; tuples,
lists and dicts are walked. Anything else (a KV-cache object, a callable) cannot be captured: Uncapturable.
"""
from __future__ import annotations

import torch

_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device)


class Uncapturable(Exception):
    """A call argument no graph can take (its type is the message)."""


def call_key(args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]]:
    key: list = []
    tensors: list[torch.Tensor] = []
    for value in args:
        _walk(value, key, tensors)
    for name in sorted(kwargs):
        key.append(name)
        _walk(kwargs[name], key, tensors)
    return tuple(key), tensors


def _walk(value, key: list, tensors: list) -> None:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        key.append((value.dtype, value.dim(), value.device.type))
    elif value is None:
        key.append(None)
    elif isinstance(value, _CONSTANTS):
        key.append((type(value), value))   # True, 1 and 1.0 are equal keys otherwise
    elif type(value) in (tuple, list):
        key.append((type(value), len(value)))
        for item in value:
            _walk(item, key, tensors)
    elif type(value) is dict:
        key.append((dict, tuple(value)))
        for item in value.values():
            _walk(item, key, tensors)
    else:
        raise Uncapturable(f"{type(value).__module__}.{type(value).__qualname__}")


class Slot:
    """Where the i-th graph input goes in a call template."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def template(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with each tensor replaced by a Slot (the order call_key lists them in)."""
    counter = iter(range(1 << 30))

    def replace(value):
        if isinstance(value, torch.Tensor):
            return Slot(next(counter))
        if type(value) in (tuple, list):
            return type(value)(replace(item) for item in value)
        if type(value) is dict:
            return {name: replace(item) for name, item in value.items()}
        return value

    filled_args = tuple(replace(value) for value in args)
    return filled_args, {name: replace(kwargs[name]) for name in sorted(kwargs)}


def fill(value, tensors):
    """The template `value` with its Slots replaced by `tensors` (real ones, or fx Proxies while tracing)."""
    if isinstance(value, Slot):
        return tensors[value.index]
    if type(value) in (tuple, list):
        return type(value)(fill(item, tensors) for item in value)
    if type(value) is dict:
        return {name: fill(item, tensors) for name, item in value.items()}
    return value
