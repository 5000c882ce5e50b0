import ast
import functools
import inspect
import os
import sys
from pathlib import Path

import pytest

# Tests import the model zoo (models/) from the repository root as `models` (installed: amp_compiler.models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# transformers and timm import torchvision when it is installed; the wheel that matches the torch pin
# needs its missing op schemas defined first (see models/torchvision_ops.py).
import models.torchvision_ops  # noqa: E402,F401

# tests/ mirrors the package in folders; a test module that imports another's helpers does so by its basename
# (unique across folders, as pytest's default import mode requires), so every folder is on sys.path, last.
_TESTS = Path(__file__).resolve().parent
sys.path.extend(str(folder) for folder in sorted(_TESTS.iterdir())
                if folder.is_dir() and folder.name not in ("golden", "__pycache__") and str(folder) not in sys.path)

# Markers, so the inner loop skips what is slow (README, "Tests": the fast command). CI runs everything.
# No test or file is named here: a mark is either written on the test itself or found from what the test uses,
# so renaming a test or a file keeps its marks.
#   real_models  the test, or a fixture it uses, names REAL_MODELS (tests/real_models.py: HF, timm, torchvision,
#                PyG, diffusers configs), or its file says `pytestmark = pytest.mark.real_models`
#   distributed  its file imports distributed_testing (two gloo ranks in subprocesses)
#   browser      it is skipped without a browser (a skipif whose reason says "browser"): headless Chromium
#   slow         written on the test: @pytest.mark.slow on a test (0.6 s or more on 2 loaded cores, or 1.5 s in
#                a full run; junit XML timings), or `pytestmark = pytest.mark.slow` in a file whose tests are
#                slow or share a costly module fixture
MARKERS = {
    "real_models": "builds models of tests/real_models.py (transformers, timm, torchvision, PyG, diffusers)",
    "distributed": "runs two torch.distributed ranks in subprocesses (tests/distributed_testing.py)",
    "browser": "drives a headless Chromium (skipped without one)",
    "slow": "a second or more on 2 busy cores (marked on the test or its file); the fast loop leaves it out",
}


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_ignore_collect(collection_path: Path, config):
    """Skip importing a file every test of which the -m expression leaves out (transformers, ONNX Runtime and
    the zoo take most of a fast run's time at import): the file's own `pytestmark`, read without importing it."""
    expression = config.getoption("markexpr", "")
    if not expression or collection_path.suffix != ".py":
        return None
    markers = file_marks(collection_path)
    return True if markers and _excludes_whatever_else(expression, markers) else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in _markers_of(item):
            item.add_marker(name)


@functools.cache
def file_marks(path: Path) -> frozenset[str]:
    """The marks a test file gives every test of its own: the `pytest.mark.NAME` (called or not) of its
    module-level `pytestmark = ...` (one mark, or a list or tuple of them), read from the source with ast
    so that a file left out by -m is never imported."""
    try:
        source = path.read_bytes()
        if b"pytestmark" not in source:
            return frozenset()
        tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError):   # pytest reports the file's own error when it imports it
        return frozenset()
    marks = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if not any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in targets):
            continue
        values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
        for value in values:
            value = value.func if isinstance(value, ast.Call) else value
            # pytest.mark.NAME, or mark.NAME after `from pytest import mark`
            if isinstance(value, ast.Attribute) and (
                    isinstance(value.value, ast.Attribute) and value.value.attr == "mark"
                    or isinstance(value.value, ast.Name) and value.value.id == "mark"):
                marks.add(value.attr)
    return frozenset(marks)


def _markers_of(item) -> set[str]:
    """The markers found from what a test uses (the ones written on a test or its file pytest applies itself)."""
    markers = set()
    if any("REAL_MODELS" in _source(function) for function in _functions(item)):
        markers.add("real_models")
    if "distributed_testing" in sys.modules and any(
            getattr(value, "__module__", None) == "distributed_testing" for value in vars(item.module).values()):
        markers.add("distributed")
    if any("browser" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif")):
        markers.add("browser")
    return markers


def _functions(item) -> list:
    """The test function and the functions of the fixtures it uses (where a real model is usually built)."""
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    return [item.function, *(d.func for defs in definitions for d in defs)]


@functools.cache
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _excludes_whatever_else(expression: str, markers: set[str]) -> bool:
    """Whether `-m expression` deselects every test carrying `markers`, whatever other markers it has."""
    try:
        from _pytest.mark.expression import Expression
        compiled = Expression.compile(expression)
    except Exception:   # noqa: BLE001 - pytest's own error comes at selection; import the file meanwhile
        return False
    others = sorted(set(MARKERS) - markers)
    for mask in range(2 ** len(others)):
        extra = {name for bit, name in enumerate(others) if mask >> bit & 1}
        for unknown in (False, True):
            if compiled.evaluate(lambda name, **kwargs: name in markers | extra or (unknown and name not in MARKERS)):
                return False
    return True
