"""What every amp-compiler subcommand parses the same way: levels, --kwarg values, shapes, MODULE:FACTORY.

    model, example_inputs, calibration_data = load_factory("models:build", ["name=gpt"])
    model, example_inputs, calibration_data = load_factory("path/to/mymodels.py:make")

MODULE:FACTORY names a function to call (with --kwarg NAME=VALUE keywords): MODULE is a module importable
from the current directory (`mymodels`, `pkg.models`) or a file path (`path/to/mymodels.py`). The factory
returns `(model, example_inputs)`, `(model, example_inputs, calibration_data)`, an object with `.model` and
`.example_inputs` (and optionally `.calibration_data`), or a bare nn.Module (then --input-shape gives
random fp32 example inputs).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch
from torch import nn

from amp_compiler.passes.policy.levels import LEVELS

LEVEL_CHOICES_HELP = "; ".join(f"{name}: {level.says}" for name, level in LEVELS.items()) + "; or auto (default O1)"


def keyword_argument(text: str) -> tuple[str, object]:
    """--kwarg NAME=VALUE: VALUE is a Python literal, or else a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--kwarg expects NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def shape_argument(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ValueError(f"--input-shape expects comma-separated integers, got {text!r}") from None


def load_factory(spec: str, kwargs: list[str] = (), shapes: list[str] = ()) -> tuple[nn.Module, tuple, list | None]:
    """Call MODULE:FACTORY (MODULE: importable from the current directory, or a .py file's path) and
    return (model, example_inputs, calibration_data or None) from what it returns (a bare module takes
    random fp32 inputs of the given `shapes`); errors say where the module was looked for."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected MODULE:FACTORY (mymodels:make or path/to/mymodels.py:make), got {spec!r}")
    module, where = _import(module_name)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{where} has no function {attribute!r}; it defines: {', '.join(defined) or 'nothing callable'}")
    made = factory(**dict(keyword_argument(k) for k in kwargs))
    if isinstance(made, nn.Module):      # a bare model: its fp32 example inputs from --input-shape
        if not shapes:
            raise ValueError(f"{spec} returned a bare module: give its example inputs with --input-shape")
        made = (made, tuple(torch.randn(*shape_argument(s)) for s in shapes))
    if hasattr(made, "model") and hasattr(made, "example_inputs"):
        made = (made.model, made.example_inputs, getattr(made, "calibration_data", None))
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise TypeError(f"{spec} returned {type(made).__name__}; a factory returns (model, example_inputs), "
                        "(model, example_inputs, calibration_data) or an object with .model and .example_inputs")
    model, inputs, calibration = (*made, None)[:3]
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), calibration


def _import(name: str):
    """The module and where it came from; a path (a / or .py) is loaded from that file."""
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"cannot load {name}: no such file (looked for {path})")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))      # the file's own imports of its neighbours work
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
        return module, f"{path}"
    cwd = os.getcwd()
    if cwd not in sys.path:   # like `python -m`: the current directory's modules are importable
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name.split(".")[0] and error.name != name:
            raise                                    # the module exists; something it imports does not
        raise ValueError(f"cannot import module {name!r}: looked in the current directory ({cwd}) and on "
                         f"Python's path; give a file path instead (path/to/{name.replace('.', '/')}.py:FACTORY)") \
            from None
    return module, f"module {name} ({getattr(module, '__file__', None) or 'built in'})"
