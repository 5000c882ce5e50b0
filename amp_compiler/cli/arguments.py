"""What every amp-compiler subcommand parses the same way: levels, --fp8-* options, --kwarg values, shapes,
MODULE:FACTORY.

    model, example_inputs, calibration_data = load_factory("models:build", ["name=gpt"])
    model, example_inputs, calibration_data = load_factory("path/to/mymodels.py:make")

MODULE:FACTORY names a function to call (with --kwarg NAME=VALUE keywords): MODULE is a module importable
from the current directory (`mymodels`, `pkg.models`) or a file path (`path/to/mymodels.py`). The factory
returns `(model, example_inputs)`, `(model, example_inputs, calibration_data)`, an object with `.model` and
`.example_inputs` (and optionally `.calibration_data`), or a bare nn.Module (then --input-shape gives
random fp32 example inputs).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

from amp_compiler.passes.policy.fp8 import AMAX_FROM, FP8_OPTION_KEYS, SCALINGS, Fp8Options
from amp_compiler.passes.policy.levels import LEVELS

LEVEL_CHOICES_HELP = "; ".join(f"{name}: {level.says}" for name, level in LEVELS.items()) + "; or auto (default O1)"


def add_fp8_options(parser: argparse.ArgumentParser, calibrates: bool = True) -> None:
    """--fp8-*: convert()'s fp8_* options (passes/policy/fp8.py), for --level fp8; given at another level, or
    --fp8-history / --fp8-amax-from without --fp8-scaling delayed, they are the usage error convert() raises.
    --fp8-max-error only where the command calibrates (`calibrates`; it needs --calibrate there)."""
    group = parser.add_argument_group("fp8 (--level fp8)")
    group.add_argument("--fp8-scaling", choices=SCALINGS,
                       help="current (default): per tensor, this call's amax; delayed: per tensor, from an amax "
                            "history; rowwise: one scale per row")
    group.add_argument("--fp8-min-dim", type=int, metavar="N",
                       help=f"matmuls with min(K, N) below N are not fp8 (default {Fp8Options.min_dim})")
    group.add_argument("--fp8-margin", type=int, metavar="M",
                       help=f"scales divided by 2**M: headroom past the measured amax (default {Fp8Options.margin})")
    group.add_argument("--fp8-keep", action="extend", nargs="+", metavar="PATTERN",
                       help="node names or module paths (glob) whose matmuls are not fp8; repeat it or give a comma list")
    group.add_argument("--fp8-history", type=int, metavar="CALLS",
                       help=f"delayed: calls the amax history holds (default {Fp8Options.history})")
    group.add_argument("--fp8-amax-from", choices=AMAX_FROM,
                       help="delayed: the history's max (default) or its most recent entry")
    if calibrates:
        group.add_argument("--fp8-max-error", type=float, metavar="E",
                           help=f"with --calibrate: a matmul whose operands' fp8 round-trip error on the samples "
                                f"exceeds E is not fp8 (default {Fp8Options.max_error:g})")


def fp8_overrides(args) -> dict:
    """The --fp8-* options given, as convert()'s keywords (those not given are left to its defaults)."""
    given = {key: getattr(args, key) for key in FP8_OPTION_KEYS if getattr(args, key, None) is not None}
    if "fp8_keep" in given:
        given["fp8_keep"] = [p.strip() for text in given["fp8_keep"] for p in text.split(",") if p.strip()]
    if "fp8_max_error" in given and not args.calibrate:   # convert() would ignore it: no samples to measure
        raise ValueError("--fp8-max-error applies with --calibrate (the samples the fp8 error is measured on)")
    return given


def calibration_samples(args, inputs: tuple, calibration: list | None) -> list | None:
    """--calibrate's samples: the factory's calibration_data, else its example inputs (said so); None without it."""
    if not args.calibrate:
        return None
    if calibration is None:
        print("range calibration on the example inputs alone (a factory may return calibration_data too)")
        return [inputs]
    return calibration


def convert_dtype(args) -> dict:
    """--dtype as convert()'s keyword: given, or float16 (the CLI's default), except at --level fp8, whose
    other low ops run in bfloat16 (convert()'s default there)."""
    if args.dtype is not None:
        return {"dtype": args.dtype}
    return {} if args.level == "fp8" else {"dtype": "float16"}


def cli_words(message: str) -> str:
    """An error of convert()'s in the words the command line uses: fp8_min_dim -> --fp8-min-dim."""
    for key in FP8_OPTION_KEYS:
        message = re.sub(rf"\b{key}\b", "--" + key.replace("_", "-"), message)
    return re.sub(r"\bdtype=torch\.(\w+)", r"--dtype \1", message)


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
