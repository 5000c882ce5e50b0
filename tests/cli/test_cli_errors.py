"""The command line for a newcomer (issue 33): every bad input is one line on stderr naming what to fix, a bad
flag value says its flag (with "did you mean" where a close name exists), and --help / --version load no torch.

The cases run in-process (capfd: everything written to the file descriptors, torch's log handlers included);
only the import checks start a Python of their own.
"""
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amp_compiler.cli import QUIETED_LOGGERS, main

ROOT = Path(__file__).resolve().parents[2]

USER_FILES = {
    "bad_syntax.py": "import torch\n\ndef make(:\n    pass\n",
    "bad_import.py": "import torch\nimport not_installed_package_xyz\n\ndef make():\n    pass\n",
    "user_models.py": textwrap.dedent('''\
        import torch
        from torch import nn


        def make():
            raise RuntimeError("the factory's own bug")


        def linear(width=4):
            return nn.Linear(width, 2), (torch.randn(2, width),)


        def bare(width=4):
            return nn.Sequential(nn.Linear(width, 3))


        class RaisesInForward(nn.Module):
            def forward(self, x):
                raise RuntimeError("the forward's own bug")


        def forward_bug():
            return RaisesInForward(), (torch.randn(2, 4),)
        '''),
}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "models", None)   # the repository's models/ is on the tests' path, not a user's
    for name in USER_FILES:
        monkeypatch.delitem(sys.modules, name[:-3], raising=False)
    for name in QUIETED_LOGGERS:      # as a fresh process has them: main() must quiet them itself
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    return tmp_path


def one_error_line(capfd, argv) -> str:
    """Run the command; it must fail with exit code 2 and exactly one line on stderr, which is returned."""
    try:
        code = main(argv)
    except SystemExit as exit_:         # a bad flag: argparse's exit
        code = exit_.code
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"amp-compiler {argv[0]}: error: "), err
    return err


# (argv, what the line must name): the cases of issue 33's table
CASES = [
    (["explain", "bad_syntax.py:make"], ["SyntaxError", "bad_syntax.py, line 3", "def make(:", "fix the file"]),
    (["explain", "bad_import:make"], ["'not_installed_package_xyz', which is not installed", "bad_import.py, line 2"]),
    (["explain", "user_models.py:make"], ["raised RuntimeError: the factory's own bug", "user_models.py, line 6, in make"]),
    (["explain", "user_models:forward_bug"], ["user_models.py, line 19, in forward: RuntimeError: the forward's own bug"]),
    (["explain", "user_models:bare"], ["returned a bare module: give its example inputs with --input-shape"]),
    (["explain", "user_models:linear", "--kwarg", "width=abc"],
     ["user_models.py, line 10, in linear", "--kwarg width=abc passed it as a string"]),
    (["explain", "user_models:linear", "--kwarg", "widht=4"], ["--kwarg widht:", "did you mean width?"]),
    (["explain", "user_models:linear", "--kwarg", "=4"], ["argument --kwarg: expects NAME=VALUE"]),
    (["compare", "user_models:bare", "--input-shape", "3,5"],
     ["do not fit the model", "the example inputs came from --input-shape 3,5"]),
    (["explain", "user_models:bare", "--input-shape", "3,x"], ["argument --input-shape: expects comma-separated"]),
    (["explain", "user_models:linear", "--level", "o1"], ["argument --level: unknown level 'o1'; did you mean O1?"]),
    (["explain", "user_models:linear", "--dtype", "bf61"], ["argument --dtype: unknown dtype 'bf61'; did you mean bf16?"]),
    (["export", "user_models:linear", "o.onnx", "--dtype", "bfloat1"], ["argument --dtype", "did you mean bfloat16?"]),
    (["explain", "user_models:linear", "--fp8-min-dim", "x"], ["argument --fp8-min-dim: invalid int value: 'x'"]),
    (["explain", "user_models:lnear"], ["has no function 'lnear'", "did you mean linear?"]),
    (["explain", "models:build", "--kwarg", "name=mlp"], ["cannot import module 'models'", "amp_compiler.models:build"]),
    (["demo", "--model", "mpl", "--steps", "0"], ["argument --model: unknown model 'mpl'; did you mean mlp?"]),
    (["demo", "--train-dtype", "fp61", "--steps", "0"], ["argument --train-dtype", "did you mean fp16?"]),
]


def test_each_bad_input_is_one_line_naming_the_fix(user_dir, capfd):
    for argv, words in CASES:
        line = one_error_line(capfd, argv)
        assert all(word in line for word in words), (argv, line)
    assert "Traceback" not in line


def test_the_bare_module_runs_once_given_input_shape(user_dir, capfd):
    assert main(["explain", "user_models:bare", "--input-shape", "2,4"]) == 0
    assert capfd.readouterr().err == ""


def test_traceback_prints_the_whole_traceback(user_dir, capfd):
    with pytest.raises(Exception, match="the factory's own bug"):
        main(["explain", "user_models.py:make", "--traceback"])


def test_help_names_the_installed_zoo_and_the_input_shape_flag(capsys):
    for command in ("explain", "compare", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "amp_compiler.models:build" in text and " models:build" not in text and "--input-shape" in text


def test_the_parsers_copies_agree_with_the_library():
    """The parser spells out what torch-importing modules define; they must agree."""
    from amp_compiler.cli import arguments, demo
    from amp_compiler.config import LOW_DTYPES
    from amp_compiler.insight.compare import FP8_RTOL
    from models import ZOO_NAMES

    assert {name: str(dtype).removeprefix("torch.") for name, dtype in LOW_DTYPES.items()} == arguments.DTYPE_NAMES
    assert float(arguments.FP8_RTOL_HELP) == FP8_RTOL and demo.ZOO_NAMES == ZOO_NAMES


IMPORTS_OF_HELP = textwrap.dedent('''\
    import sys
    {prelude}
    from amp_compiler.cli import main
    for argv in (["--help"], ["--version"], ["explain", "--help"], ["explain", "m:f", "--level", "o1"]):
        try:
            main(argv)
        except SystemExit:
            pass
    print(sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "numpy", "onnx", "onnxruntime")))
    ''')
# a package root that imports nothing: what the command's own modules import, apart from amp_compiler/__init__.py
BARE_ROOT = ("import types; root = types.ModuleType('amp_compiler'); root.__path__ = [{path!r}]; "
             "root.__version__ = '0'; sys.modules['amp_compiler'] = root")


def heavy_modules_loaded(prelude: str) -> str:
    run = subprocess.run([sys.executable, "-c", IMPORTS_OF_HELP.format(prelude=prelude)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.splitlines()[-1]


def test_parsing_imports_no_torch():
    """--help, --version and a bad flag: the command's modules build the parser without torch."""
    assert heavy_modules_loaded(BARE_ROOT.format(path=str(ROOT / "amp_compiler"))) == "[]"


def test_help_and_version_import_no_torch():
    """The package root loads its names on first use (PEP 562): --help and --version never import torch."""
    assert heavy_modules_loaded("") == "[]"
