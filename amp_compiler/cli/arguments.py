"""What every amp-compiler subcommand parses the same way: levels, dtypes, --fp8-* options, --kwarg values,
shapes, MODULE:FACTORY; and how an error becomes the one line the command prints.

    model, example_inputs, calibration_data = load_factory("amp_compiler.models:build", ["name=gpt"])
    model, example_inputs, calibration_data = load_factory("path/to/mymodels.py:make")

MODULE:FACTORY names a function to call (with --kwarg NAME=VALUE keywords): MODULE is a module importable
from the current directory (`mymodels`, `pkg.models`) or a file path (`path/to/mymodels.py`). The factory
returns `(model, example_inputs)`, `(model, example_inputs, calibration_data)`, an object with `.model` and
`.example_inputs` (and optionally `.calibration_data`), or a bare nn.Module (then --input-shape gives
random fp32 example inputs).

This module imports no torch at its top: the parsers are built (and --help answered) before torch loads.
Flag values are checked while parsing (level_argument, dtype_argument, kwarg_argument, shape_argument), so a
bad one is argparse's error naming the flag, with a "did you mean" where a close name exists. An error raised
while loading or calling the user's file is a UserCodeError naming the file, the line and the fix.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from pathlib import Path

from amp_compiler.passes.policy.fp8 import AMAX_FROM, FP8_OPTION_KEYS, SCALINGS, Fp8Options
from amp_compiler.passes.policy.levels import LEVELS

LEVEL_CHOICES_HELP = "; ".join(f"{name}: {level.says}" for name, level in LEVELS.items()) + "; or auto (default O1)"
LEVEL_NAMES = (*LEVELS, "auto")
# amp_compiler.config.LOW_DTYPES' names (tests/test_cli_errors.py checks they agree), without importing torch
DTYPE_NAMES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
FP8_RTOL_HELP = "0.15"   # amp_compiler.insight.compare.FP8_RTOL, which imports torch (the test checks they agree)
ZOO_FACTORY = "amp_compiler.models:build"
# The user's files load_factory loaded: a traceback through one of them is the user's code failing.
USER_FILES: set[str] = set()


class UserCodeError(ValueError):
    """Loading or calling the user's MODULE:FACTORY failed; the message names the file, line and fix."""


class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage error is one line (the usage block stays in --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def did_you_mean(text: str, names) -> str:
    """' (did you mean X?)' for the name closest to `text` (case aside), or ''."""
    by_lower = {name.lower(): name for name in names}
    close = difflib.get_close_matches(text.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]}?" if close else ""


def level_argument(text: str) -> str:
    """--level: O0..O3, fp8 or auto, exactly as convert() takes them."""
    if text in LEVEL_NAMES:
        return text
    raise argparse.ArgumentTypeError(f"unknown level {text!r}{did_you_mean(text, LEVEL_NAMES)} "
                                     f"(levels: {', '.join(LEVEL_NAMES)})")


def dtype_argument(text: str) -> str:
    """--dtype: a low dtype's name (float16, fp16, half, bfloat16, bf16), returned as its full name."""
    if text.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[text.lower()]
    raise argparse.ArgumentTypeError(f"unknown dtype {text!r}{did_you_mean(text, DTYPE_NAMES)} "
                                     f"(dtypes: {', '.join(DTYPE_NAMES)})")


def kwarg_argument(text: str) -> str:
    """--kwarg NAME=VALUE, checked for its form here; load_factory reads the value."""
    name, sep, _ = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expects NAME=VALUE with NAME a Python name (width=4, name='gpt'), "
                                         f"got {text!r}")
    return text


def shape_argument(text: str) -> str:
    """--input-shape D0,D1,...: positive integers, checked here; load_factory makes the tensor."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expects comma-separated positive integers (2,8), got {text!r}")
    return text


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


def add_factory_inputs(parser: argparse.ArgumentParser) -> None:
    """--kwarg and --input-shape: what MODULE:FACTORY is called with, and a bare module's example inputs."""
    parser.add_argument("--kwarg", action="append", default=[], metavar="NAME=VALUE", type=kwarg_argument,
                        help="keyword argument for the factory; VALUE is a Python literal or else a string")
    parser.add_argument("--input-shape", action="append", default=[], metavar="D0,D1,...", type=shape_argument,
                        help="shape of one fp32 example input, when the factory returns a bare module (repeat it "
                             "for each input)")


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


def load_factory(spec: str, kwargs: list[str] = (), shapes: list[str] = ()) -> tuple:
    """Call MODULE:FACTORY (MODULE: importable from the current directory, or a .py file's path) and
    return (model, example_inputs, calibration_data or None) from what it returns (a bare module takes
    random fp32 inputs of the given `shapes`); errors say where the module was looked for, and an error
    of the user's code says its file and line."""
    import torch
    from torch import nn

    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected MODULE:FACTORY (mymodels:make, path/to/mymodels.py:make or {ZOO_FACTORY} "
                         f"--kwarg name=gpt), got {spec!r}")
    module, where = _import(module_name)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{where} has no function {attribute!r}; it defines: "
                         f"{', '.join(defined) or 'nothing callable'}{did_you_mean(attribute, defined)}")
    keywords = dict(keyword_argument(k) for k in kwargs)
    _check_keywords(spec, factory, keywords)
    try:
        made = factory(**keywords)
    except Exception as error:
        raise UserCodeError(_user_code_error(f"{spec} raised", error, _string_kwarg_fix(kwargs, keywords))) \
            from error
    if isinstance(made, nn.Module):      # a bare model: its fp32 example inputs from --input-shape
        if not shapes:
            raise ValueError(f"{spec} returned a bare module: give its example inputs with --input-shape "
                             "(e.g. --input-shape 2,8; once per input)")
        made = (made, tuple(torch.randn(*(int(d) for d in s.split(","))) for s in shapes))
    if hasattr(made, "model") and hasattr(made, "example_inputs"):
        made = (made.model, made.example_inputs, getattr(made, "calibration_data", None))
    if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
        raise TypeError(f"{spec} returned {type(made).__name__}; a factory returns (model, example_inputs), "
                        "(model, example_inputs, calibration_data) or an object with .model and .example_inputs")
    model, inputs, calibration = (*made, None)[:3]
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), calibration


def _check_keywords(spec: str, factory, keywords: dict) -> None:
    """--kwarg names the factory does not take: said with the flag, before the factory runs."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):      # a builtin without a signature: the call says it
        return
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    taken = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in keywords:
        if name not in taken:
            raise ValueError(f"--kwarg {name}: {spec} takes no keyword {name!r}{did_you_mean(name, taken)} "
                             f"(it takes: {', '.join(taken) or 'none'})")


def _string_kwarg_fix(texts, keywords: dict) -> str | None:
    """Where a --kwarg value was no Python literal it reached the factory as a string, often the reason it
    failed: the fix to suggest, or None."""
    strings = [t for t in texts if isinstance(keywords.get(t.partition("=")[0]), str)
               and not t.partition("=")[2].startswith(("'", '"'))]
    if not strings:
        return None
    given = ", ".join(f"--kwarg {t}" for t in strings)
    return f"{given} passed {'it' if len(strings) == 1 else 'them'} as a string: give a Python literal (NAME=4) if a " \
           "number was meant"


def _user_code_error(what: str, error: BaseException, fix: str | None = None) -> str:
    """'<what> TypeError: <first line> (file.py, line 12, in make); fix it there' for an error whose traceback
    passes through one of USER_FILES (the deepest such frame), or a SyntaxError's own file and line; `fix`
    replaces 'fix it there' where the command line is the likelier culprit."""
    if isinstance(error, SyntaxError) and error.filename:
        text = (error.text or "").strip()
        return (f"{what} SyntaxError: {error.msg} ({error.filename}, line {error.lineno}"
                + (f": {text}" if text else "") + "); fix the file")
    frame = user_frame(error)
    where = f" ({frame.filename}, line {frame.lineno}, in {frame.name})" if frame else ""
    if isinstance(error, ModuleNotFoundError) and error.name:
        return (f"{what} ModuleNotFoundError: it imports {error.name!r}, which is not installed or not on Python's "
                f"path{where}; install it (pip install ...) or run from the folder that holds it")
    fix = fix or ("fix it there" if frame else None)
    return f"{what} {type(error).__name__}: {first_line(error)}{where}" + (f"; {fix}" if fix else "")


def user_frame(error: BaseException):
    """The deepest traceback frame in one of the user's files (USER_FILES), through causes; or None."""
    return user_failure(error)[0]


def user_failure(error: BaseException) -> tuple:
    """(the deepest frame in one of USER_FILES, the exception whose traceback holds it), through the
    exception's causes; (None, None) where the user's code is not in it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.realpath(f.filename) in USER_FILES]
        if frames:
            return frames[-1], error
        error = error.__cause__ or error.__context__
    return None, None


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else repr(error)


def _import(name: str):
    """The module and where it came from; a path (a / or .py) is loaded from that file. The module's file
    joins USER_FILES; an error running it is a UserCodeError naming its line."""
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"cannot load {name}: no such file (looked for {path})")
        USER_FILES.add(os.path.realpath(path))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))      # the file's own imports of its neighbours work
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise UserCodeError(_user_code_error(f"cannot load {name}:", error)) from error
        finally:
            sys.path.remove(str(path.parent))
        return module, f"{path}"
    cwd = os.getcwd()
    if cwd not in sys.path:   # like `python -m`: the current directory's modules are importable
        sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:   # a parent package of a dotted name is missing
        found = None
    except Exception as error:    # a parent package exists; running its __init__ failed
        raise UserCodeError(_user_code_error(f"cannot import {name}:", error)) from error
    if found is None:
        zoo = f" (the model zoo is {ZOO_FACTORY})" if name == "models" else ""
        raise ValueError(f"cannot import module {name!r}: looked in the current directory ({cwd}) and on "
                         f"Python's path; give a file path instead (path/to/{name.replace('.', '/')}.py:FACTORY)"
                         + zoo)
    if found.origin and found.has_location:
        USER_FILES.add(os.path.realpath(found.origin))
    try:
        module = importlib.import_module(name)
    except Exception as error:      # the module exists; running it failed (a syntax error, a missing import)
        raise UserCodeError(_user_code_error(f"cannot import {name}:", error)) from error
    return module, f"module {name} ({getattr(module, '__file__', None) or 'built in'})"



def report_error(command: str, error: Exception, args=None) -> int:
    """Print `error` as the command's one line on stderr; returns the exit code: 2 for a usage error or the
    user's code failing (ValueError, TypeError, a missing file), 3 for anything else."""
    print(f"amp-compiler {command}: error: {error_line(error, args)}", file=sys.stderr)
    return 2 if isinstance(error, (ValueError, TypeError, OSError)) or user_frame(error) is not None else 3


def error_line(error: Exception, args=None) -> str:
    """The error in one line, in the command line's words: where the user's code raised it (file, line) and,
    for inputs that came from --input-shape, that flag; anything else says how to see the whole traceback."""
    message = " ".join(first_line(error).split()) if not isinstance(error, (ValueError, TypeError)) else \
        " ".join(str(error).split())
    if isinstance(error, UserCodeError):
        return cli_words(message)
    if not isinstance(error, (ValueError, TypeError, OSError)):
        message = f"{type(error).__name__}: {message}"
    frame, raised = user_failure(error)
    if frame is not None:
        cause = f": {type(raised).__name__}: {' '.join(first_line(raised).split())}" if raised is not error else ""
        message += f" ({frame.filename}, line {frame.lineno}, in {frame.name}{cause})"
    shapes = getattr(args, "input_shape", None)
    if shapes and "do not fit the model" in message:
        message += "; the example inputs came from " + " ".join(f"--input-shape {s}" for s in shapes) + \
                   ": give the shapes the model takes"
    if frame is None and not isinstance(error, (ValueError, TypeError, OSError)):
        message += " (`amp-compiler --traceback ...` prints the whole traceback; report it if amp-compiler is at fault)"
    return cli_words(message)
