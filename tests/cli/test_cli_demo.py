"""`amp-compiler demo`: the quick start's main job, from the repository and from an installed package."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from amp_compiler.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_demo_converts_reports_compares_and_trains(capsys, tmp_path):
    html = tmp_path / "mlp.html"
    assert main(["demo", "--model", "mlp", "--steps", "8", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "level O1" in out and "leaf modules kept whole" in out and "nodes: " in out
    assert "rows, by module" not in out and "totals:" not in out          # the summary, not the table
    assert f"graph and rules of all " in out and str(html.resolve()) in out and html.stat().st_size > 10_000
    assert "casts inserted:" in out and "max |mixed - fp32|" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 8 and "scaling: DynamicLossScaleManager(" in out
    # the start scale, 2**24, overflows float16 on the first step: the scale backs off, and the line says so
    assert "loss scale 2**24 -> 2**23  skipped: the scale is calibrating itself (2**24 -> 2**23)" in steps[0]
    assert "applied" in out.splitlines()[-1] and out.count("skipped with inf/nan") == 1
    assert "skipped steps:" not in out      # the step's report says the count, once


def test_demo_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--model", "mpl", "--steps", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --model: unknown model 'mpl'; did you mean mlp?" in err


@pytest.mark.slow
def test_the_installed_command_runs_the_demo_from_any_folder(tmp_path):
    """`pip install`, then the demo in a folder of the user's: the package built from a copy of the
    sources and installed into a folder of its own, run with the repository nowhere on sys.path."""
    source, site, work = tmp_path / "source", tmp_path / "site", tmp_path / "work"
    for folder in ("amp_compiler", "passes", "models"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    work.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    code = ("import sys, amp_compiler\n"
            f"assert amp_compiler.__file__.startswith({str(site)!r}), amp_compiler.__file__\n"
            "from amp_compiler.cli import main\n"
            "assert main(['demo', '--model', 'mlp', '--steps', '2', '--html', 'graph.html']) == 0\n"
            f"assert {str(ROOT)!r} not in sys.path and 'models' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "casts inserted:" in run.stdout and run.stdout.count("  loss scale ") == 2
    assert (work / "graph.html").stat().st_size > 10_000
