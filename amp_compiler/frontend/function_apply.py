"""Every custom torch.autograd.Function call goes through `Function.apply`: both front ends watch it.

    Fn.apply(x)                        -> intercept(Fn, apply, (x,), {})   (the classmethod, patched)
    gelu = Fn.apply  (at import)       -> the same, from Fn.forward         (the alias holds the original
    gelu(x)                                                                 apply: each forward is watched too)
Without the second, fx traced an aliased Function's forward as plain ops and its own backward was lost
(gradients of a straight-through estimator silently wrong); torch.export inlined it without a word.
"""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
from torch.autograd.function import _is_setup_context_defined

_APPLY = torch.autograd.Function.__dict__["apply"]


def original_apply(cls):
    """`cls.apply` as torch defines it, also while intercepted: what a graph calls at run time."""
    return _APPLY.__get__(None, cls)


@contextlib.contextmanager
def intercepted_function_apply(intercept):
    """While active, `Fn.apply(*args, **kwargs)` returns `intercept(Fn, apply, args, kwargs)`, where
    `apply(*args, **kwargs)` runs the Function as usual; so does a call through an alias of Fn.apply."""
    applying: set[type] = set()   # inside the patched apply: their forward is not intercepted again

    def apply(cls, *args, **kwargs):
        def run(*a, **k):
            applying.add(cls)
            try:
                return original_apply(cls)(*a, **k)
            finally:
                applying.discard(cls)
        return intercept(cls, run, args, kwargs)

    with mock.patch.object(torch.autograd.Function, "apply", classmethod(apply)), \
            _forwards_watched(intercept, applying):
        yield


@contextlib.contextmanager
def _forwards_watched(intercept, applying: set):
    """Each Function's forward, reached from the original apply (an alias), calls `intercept` itself."""
    skipped: set[int] = set()   # outputs the intercept made without running forward: no context to set up
    patched = []
    for cls in _subclasses(torch.autograd.Function):
        forward = cls.__dict__.get("forward")
        if not isinstance(forward, staticmethod):
            continue
        patched.append((cls, "forward", forward))
        cls.forward = staticmethod(_watched(cls, forward.__func__, intercept, applying, skipped))
        setup = cls.__dict__.get("setup_context")
        if isinstance(setup, staticmethod) and _is_setup_context_defined(setup.__func__):
            patched.append((cls, "setup_context", setup))
            cls.setup_context = staticmethod(_setup_unless_skipped(setup.__func__, skipped))
    try:
        yield
    finally:
        for cls, name, original in patched:
            setattr(cls, name, original)


def _watched(cls, forward, intercept, applying: set, skipped: set):
    takes_ctx = not _is_setup_context_defined(cls.setup_context)

    @functools.wraps(forward)
    def watched(*args, **kwargs):
        if cls in applying:
            return forward(*args, **kwargs)
        ctx, inputs = (args[0], args[1:]) if takes_ctx else (None, args)
        ran = []

        def run(*a, **k):
            ran.append(True)
            return forward(ctx, *a, **k) if takes_ctx else forward(*a, **k)
        output = intercept(cls, run, inputs, kwargs)
        if not ran:
            skipped.add(id(output))
        return output
    return watched


def _setup_unless_skipped(setup, skipped: set):
    @functools.wraps(setup)
    def setup_context(ctx, inputs, output):
        if id(output) in skipped:
            skipped.discard(id(output))
            return None
        return setup(ctx, inputs, output)
    return setup_context


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
