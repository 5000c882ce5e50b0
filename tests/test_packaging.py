"""What installing the package puts where: pyproject's package list, nothing hooked into the import system, the
license and typing metadata, and an sdist without the tests (they need the repository's conftest, helpers and golden/)."""
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "amp_compiler").rglob("__init__.py")}
    for top_level in ("passes", "models"):     # repository folders installed inside amp_compiler
        folders |= {".".join(("amp_compiler", *p.parent.relative_to(ROOT).parts))
                    for p in (ROOT / top_level).rglob("__init__.py")}
    assert listed == folders
    assert config["package-dir"] == {"amp_compiler.passes": "passes", "amp_compiler.models": "models"}


def test_importing_amp_compiler_installs_no_import_hook():
    # 0.2.0 answers no old module names (CHANGELOG): `import amp_compiler` leaves sys.meta_path as it found it
    code = ("import sys\n"
            "before = list(sys.meta_path)\n"
            "import amp_compiler, amp_compiler.train\n"
            "assert sys.meta_path == before, (before, sys.meta_path)\n"
            "assert not hasattr(amp_compiler, 'load') and 'load' not in amp_compiler.__all__\n"
            "assert not hasattr(amp_compiler.train, 'demo_training')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-1500:]


def test_license_metadata_and_typing_marker():
    """BSD-3-Clause as the PyTorch ecosystem's packages, said in the field, the file and the wheel's py.typed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    meta, setuptools_config = project["project"], project["tool"]["setuptools"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Copyright (c) 2026, the amp-compiler maintainers" in text
    assert meta["license"] == "BSD-3-Clause" and meta["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in meta["classifiers"])   # PEP 639: the expression says it
    assert "Typing :: Typed" in meta["classifiers"] and meta["keywords"]
    assert meta["urls"]["Homepage"] == "https://github.com/amp-compiler/amp-compiler"
    assert (ROOT / "amp_compiler" / "py.typed").is_file()
    assert setuptools_config["package-data"]["amp_compiler"] == ["py.typed"]


def test_the_sdist_carries_no_tests_and_the_license(tmp_path):
    """The tests need conftest.py, helpers, golden/ and the dev extras: the sdist leaves them all out (MANIFEST.in)
    rather than shipping test files that cannot collect. Built from a copy, so the checkout stays as it was."""
    import tarfile
    source = tmp_path / "source"
    for folder in ("amp_compiler", "passes", "models", "docs", "tests"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    build = "from setuptools import build_meta; print(build_meta.build_sdist(%r))" % str(tmp_path)
    run = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    with tarfile.open(tmp_path / run.stdout.split()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    assert {"LICENSE", "README.md", "CHANGELOG.md", "amp_compiler/py.typed", "amp_compiler/cli/__init__.py",
            "passes/pipelines.py", "models/__init__.py"} <= names
