"""Look up and replace modules by path in a module tree the caller owns (the inference-copy passes share it).

    set_module(root, "layer1.0.bn1", nn.Identity())      root.layer1[0].bn1 is now an Identity
    fresh_copy(conv)                                      a new Conv2d object with its own parameter dict
"""
from __future__ import annotations

import operator

from torch import nn


def get_module(root: nn.Module, path: str):
    """The module (or attribute) at `path`, None when there is none."""
    try:
        return operator.attrgetter(path)(root) if path else root
    except AttributeError:
        return None


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent), name, module)


def fresh_copy(module: nn.Module) -> nn.Module:
    """A new module object of the same class and settings, with its own parameter/buffer/hook dicts (the
    tensors in them are shared): setting an attribute or a parameter on it leaves `module` as it was."""
    clone = object.__new__(type(module))
    clone.__dict__.update({k: v.copy() if isinstance(v, (dict, set)) else v for k, v in module.__dict__.items()})
    return clone
