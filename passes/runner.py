"""The pass runner for both IRs: a pipeline is a named list of passes that prints as it runs.

    >>> print(FX_PIPELINE)        # passes/pipelines.py, with every other pipeline
    fx pipeline:
      1. canonicalize
      2. propagate_values           only when the front end recorded no values
      ...
    >>> FX_PIPELINE.run(state)    # {"canonicalize": {...}, "decide_precision": {"low": 12, "fp32": 3}, ...}

A pass is a name and a function of the pipeline's state (the graph, the conversion's choices) that
returns a PassResult, with the node facts (node_facts.py) it reads and writes. The runner keeps each
pass's counts under the pass's name (two passes may count the same thing), names the pass in any error
raised while it runs, refuses a pipeline where a pass reads a fact no earlier pass (nor the front end)
writes, and, inside `checking_passes()` (tests, debugging) or with AMP_COMPILER_CHECK_PASSES=1, runs the
pipeline's invariant checks after every pass and checks that the pass read and wrote only the facts it
declares, so a broken invariant or an undeclared fact is blamed on the pass and the node.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from amp_compiler.passes.node_facts import NodeFacts


@dataclass
class PassResult:
    """What a pass did: whether it changed the graph, and what it counted."""
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Condition:
    """When a pass runs: a test of the pipeline's state and the same in words. `a & b` holds where both do."""
    holds: Callable[[Any], bool]
    says: str

    def __call__(self, state) -> bool:
        return self.holds(state)

    def __and__(self, other: Condition) -> Condition:
        return Condition(lambda state: self.holds(state) and other.holds(state), f"{self.says}, {other.says}")


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Any], PassResult]
    when: Condition | None = None   # run only where this holds for the state
    reads: tuple[str, ...] = ()     # node facts it reads: an earlier pass, or the front end, writes each
    writes: tuple[str, ...] = ()    # node facts it adds, changes or removes (node_facts.py names the writers)
    graph_writes: tuple[str, ...] = ()   # graph-level facts it records (graph.meta, a value's meta), for the reader
    steps: tuple[str, ...] = ()     # what the pass composes, in order, printed under it (decide's hooks)

    def __str__(self) -> str:
        head = f"{self.name:<26} only {self.when.says}" if self.when is not None else self.name
        return "\n".join([head, *(f"       - {step}" for step in self.steps)])

    def facts_line(self) -> str:
        graph = f"; records {', '.join(self.graph_writes)}" if self.graph_writes else ""
        return (f"{self.name:<26} reads {', '.join(self.reads) or '-'}; writes {', '.join(self.writes) or '-'}"
                f"{graph}")


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
    nodes: Callable[[Any], Iterable] | None = None  # the nodes whose facts the passes read and write
    front_end_facts: tuple[str, ...] = ()           # facts the nodes carry before the first pass

    def __post_init__(self) -> None:
        names = [p.name for p in self.passes]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"pipeline {self.name!r} names {repeated} twice: give each run of a pass its own name")
        written = set(self.front_end_facts)
        for step in self.passes:   # at import: a pass that reads a fact nothing before it writes is an ordering bug
            unknown = sorted((set(step.reads) | set(step.writes)) - set(NodeFacts.__annotations__))
            missing = sorted(set(step.reads) - written)
            if unknown or missing:
                raise ValueError(f"pipeline {self.name!r}, pass {step.name!r}: "
                                 + (f"facts {unknown} are not in node_facts.py" if unknown else
                                    f"reads {missing}, which no earlier pass nor the front end writes"))
            written |= set(step.writes)

    def __str__(self) -> str:
        return "\n".join([f"{self.name} pipeline:", *(f"{i:3}. {p}" for i, p in enumerate(self.passes, 1))])

    def facts_table(self) -> str:
        """The pipeline with the node facts each pass reads and writes."""
        return "\n".join([f"{self.name} pipeline (front end: {', '.join(self.front_end_facts) or '-'}):",
                          *(f"{i:3}. {p.facts_line()}" for i, p in enumerate(self.passes, 1))])

    def run(self, state) -> dict[str, dict[str, int]]:
        """Run the passes in order on `state`; returns {pass name: its counts} for the passes that ran."""
        counts: dict[str, dict[str, int]] = {}
        checking = checks_enabled()
        for step in self.passes:
            if step.when is not None and not step.when(state):
                continue
            try:
                if checking and self.nodes is not None:
                    result = _run_watching_facts(step, state, self.nodes)
                else:
                    result = step.run(state)
                if checking and self.check is not None:
                    self.check(state)
            except Exception as error:
                _name_the_pass(error, f"in pass {step.name!r} of the {self.name} pipeline")
                raise
            counts[step.name] = dict(result.counts)
        return counts


def count(counts: dict[str, dict[str, int]], key: str) -> int:
    """The total of `key` over every pass that counted it."""
    return sum(c.get(key, 0) for c in counts.values())


class _ReadsRecorded(dict):
    """A node's facts while a pass runs under checking_passes(): the keys read (that were there) are recorded;
    looking for a fact no pass wrote yet ("class" not in facts: before painting) is not reading it."""
    __slots__ = ("looked_up",)

    def __init__(self, record):
        super().__init__(record)
        self.looked_up = set()

    def _read(self, key) -> None:
        if super().__contains__(key):
            self.looked_up.add(key)

    def __getitem__(self, key):
        self._read(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._read(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._read(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self._read(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self._read(key)
        return super().pop(key, *default)


def _run_watching_facts(step: Pass, state, nodes: Callable[[Any], Iterable]) -> PassResult:
    """Run `step` with every node's facts recording lookups; raise unless what it read and wrote is declared."""
    result, read, wrote = facts_used(step, state, nodes)
    undeclared = {"wrote": {k: n for k, n in wrote.items() if k not in step.writes},
                  "read": {k: n for k, n in read.items() if k not in step.reads and k not in step.writes}}
    for did, keys in undeclared.items():
        if keys:
            key, node = sorted(keys.items())[0]
            raise RuntimeError(f"pass {step.name!r} {did} facts {sorted(keys)} it does not declare (first: "
                               f"{key!r} on node {getattr(node, 'name', node)!r}); declare them in its Pass "
                               f"({'writes' if did == 'wrote' else 'reads'}=...) and in node_facts.py")
    return result


def facts_used(step: Pass, state, nodes: Callable[[Any], Iterable]) -> tuple[PassResult, dict, dict]:
    """Run `step`; returns its result and the facts it read and wrote, each with the first node it did so on."""
    before, recorders = {}, []
    for node in nodes(state):
        record = node.meta.get("amp")
        if record is not None:
            before[node] = _copy(record)
        node.meta["amp"] = _ReadsRecorded(record or {})
        recorders.append((node, node.meta["amp"]))
    try:
        result = step.run(state)
    finally:
        read, wrote, seen = {}, {}, _values_before(before)
        for node, recorder in recorders:   # nodes the pass removed too: it may read before it removes
            for key in recorder.looked_up:
                read.setdefault(key, node)
        for node in nodes(state):
            record = node.meta.get("amp")
            if isinstance(record, _ReadsRecorded):   # plain dicts again, so nothing downstream sees the recorder
                if record or node in before:
                    node.meta["amp"] = dict(record)
                else:
                    del node.meta["amp"]
            if node not in before:   # a node the pass added: facts copied from a node that was there are not its
                for key, value in (record or {}).items():
                    if _seen(value) not in seen(key):
                        wrote.setdefault(key, node)
                continue
            old = before[node]
            for key in set(old) | set(record or {}):
                if key not in old or key not in (record or {}) or not _same(old[key], record[key]):
                    wrote.setdefault(key, node)
    return result, read, wrote


def _values_before(before: dict) -> Callable[[str], set]:
    values: dict[str, set] = {}

    def seen(key: str) -> set:
        if key not in values:
            values[key] = {_seen(record[key]) for record in before.values() if key in record}
        return values[key]
    return seen


def _seen(value) -> str:
    return f"{type(value).__name__}:{value!r}"


def _copy(record: dict) -> dict:
    try:
        return copy.deepcopy(record)   # a nested record (range) may be changed in place
    except Exception:  # noqa: BLE001 - a value that cannot be copied is compared by identity
        return dict(record)


def _same(old, new) -> bool:
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # noqa: BLE001 - values without a truthful == (tensors) count as changed
        return False


def _name_the_pass(error: Exception, where: str) -> None:
    if getattr(error, "amp_pass", None):
        return
    error.amp_pass = where   # type: ignore[attr-defined]
    if hasattr(error, "add_note"):
        error.add_note(where)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} ({where})", *error.args[1:])
