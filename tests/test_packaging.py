"""What installing the package puts where: pyproject's package list, and nothing hooked into the import system."""
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
