"""The pass runner for both IRs: a pipeline is a named list of passes that prints as it runs.

    >>> print(FX_PIPELINE)        # amp_compiler/convert.py
    fx pipeline:
      1. canonicalize
      2. propagate_values           only when the front end recorded no values
      ...
    >>> FX_PIPELINE.run(state)    # {"canonicalize": {...}, "decide_precision": {"low": 12, "fp32": 3}, ...}

A pass is a name and a function of the pipeline's state (the graph, the conversion's choices) that
returns a PassResult. The runner keeps each pass's counts under the pass's name (two passes may count
the same thing), names the pass in any error raised while it runs, and, inside `checking_passes()`
(tests, debugging) or with AMP_COMPILER_CHECK_PASSES=1, runs the pipeline's invariant checks after
every pass, so a broken invariant is blamed on the pass that broke it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class PassResult:
    """What a pass did: whether it changed the graph, and what it counted."""
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Any], PassResult]
    when: Callable[[Any], bool] | None = None     # run only where this holds for the state
    when_says: str = ""                           # that condition in words, for printing

    def __str__(self) -> str:
        return f"{self.name:<26} only {self.when_says}" if self.when_says else self.name


_CHECKING = contextvars.ContextVar("amp_compiler_checking_passes", default=False)


@contextlib.contextmanager
def checking_passes():
    """Run every pipeline's invariant checks after each of its passes while inside this block."""
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checks_enabled() -> bool:
    return _CHECKING.get() or os.environ.get("AMP_COMPILER_CHECK_PASSES", "") not in ("", "0")


@dataclass(frozen=True)
class Pipeline:
    name: str
    passes: tuple[Pass, ...]
    check: Callable[[Any], None] | None = None     # the invariants every pass keeps (passes/README.md)

    def __post_init__(self) -> None:
        names = [p.name for p in self.passes]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"pipeline {self.name!r} names {repeated} twice: give each run of a pass its own name")

    def __str__(self) -> str:
        return "\n".join([f"{self.name} pipeline:", *(f"{i:3}. {p}" for i, p in enumerate(self.passes, 1))])

    def run(self, state) -> dict[str, dict[str, int]]:
        """Run the passes in order on `state`; returns {pass name: its counts} for the passes that ran."""
        counts: dict[str, dict[str, int]] = {}
        checking = self.check is not None and checks_enabled()
        for step in self.passes:
            if step.when is not None and not step.when(state):
                continue
            try:
                result = step.run(state)
                if checking:
                    self.check(state)
            except Exception as error:
                _name_the_pass(error, f"in pass {step.name!r} of the {self.name} pipeline")
                raise
            counts[step.name] = dict(result.counts)
        return counts


def count(counts: dict[str, dict[str, int]], key: str) -> int:
    """The total of `key` over every pass that counted it."""
    return sum(c.get(key, 0) for c in counts.values())


def _name_the_pass(error: Exception, where: str) -> None:
    if getattr(error, "amp_pass", None):
        return
    error.amp_pass = where   # type: ignore[attr-defined]
    if hasattr(error, "add_note"):
        error.add_note(where)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} ({where})", *error.args[1:])
