"""Files saved by the previous release name helpers by old module paths (passes.insert_casts.amp_cast...):
they keep loading through amp_compiler.load / loading_old_files(), no module is ever imported under two
names, and the top-level name `passes` stays the user's outside those loads."""
import importlib
import io
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

import amp_compiler
from amp_compiler.legacy_names import loading_old_files
from amp_compiler.passes.fx import runtime

ROOT = Path(__file__).resolve().parents[1]

# What the previous release's generated code imported, by the helper's name.
OLD_HOMES = {"amp_cast": "passes.insert_casts", "amp_module_call": "passes.lower_leaf_modules",
             "amp_opaque_call": "passes.opaque_calls",
             "dropout_p_when_training": "amp_compiler.frontend.export_capture"}


class _OldFile:
    """Pickles a GraphModule the way the previous release did: its import lines name the old modules."""

    def __init__(self, gm: fx.GraphModule):
        self.body, block = gm.__reduce__()[1]
        self.import_block = re.sub(r"^from (\S+) import (\w+) as",
                                   lambda m: f"from {OLD_HOMES.get(m[2], m[1])} import {m[2]} as",
                                   block, flags=re.M)

    def __reduce__(self):
        return fx.graph_module.reduce_graph_module, (self.body, self.import_block)


class GruNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gru = nn.GRU(4, 4, batch_first=True)

    def forward(self, x):
        out, _ = self.gru(self.fc(x))
        return out.softmax(-1)


def test_old_qualified_names_are_the_same_objects():
    with loading_old_files():
        for name, old in OLD_HOMES.items():
            assert getattr(importlib.import_module(old), name) is getattr(runtime, name)
        assert importlib.import_module("passes") is importlib.import_module("amp_compiler.passes")
    assert not [name for name in sys.modules if name.split(".")[0] == "passes"], "the old names outlived the load"
    old_manager = importlib.import_module("amp_compiler.loss_scale").DynamicLossScaleManager
    assert old_manager is amp_compiler.DynamicLossScaleManager   # pickled managers name the old module


@pytest.fixture(scope="module")
def old_file(tmp_path_factory):
    """A converted GRU net saved as the previous release saved it (old.pt), an input and the output it
    gives (io.pt); returns the folder, the input and the output."""
    folder = tmp_path_factory.mktemp("old_file")
    model, x = GruNet(), torch.randn(2, 3, 4)
    gm = amp_compiler.convert(model, "O3", example_inputs=(x,), dtype=torch.bfloat16).eval()
    old = _OldFile(gm)
    assert "from passes.insert_casts import amp_cast" in old.import_block
    assert "from passes.lower_leaf_modules import amp_module_call" in old.import_block
    torch.save(old, folder / "old.pt")
    torch.save((x, gm(x)), folder / "io.pt")
    return folder, x, gm(x)


def test_a_graph_module_saved_with_the_old_module_paths_loads_and_saves_with_the_new_ones(old_file):
    folder, x, expected = old_file
    loaded = amp_compiler.load(folder / "old.pt", weights_only=False)
    assert torch.equal(loaded.eval()(x), expected)
    helpers = {n.target.__name__ for n in loaded.graph.nodes if n.op == "call_function"}
    assert {"amp_cast", "amp_module_call"} <= helpers   # still one node each, not traced through
    buffer = io.BytesIO()
    torch.save(loaded, buffer)
    assert b"passes.insert_casts" not in buffer.getvalue()
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).eval()(x), expected)   # no old names needed


def test_old_names_load_in_a_fresh_interpreter_from_a_source_checkout():
    # From the repository root a plain `import passes` finds the folder itself: under loading_old_files()
    # the old names answer with amp_compiler.passes, never load the pass modules a second time.
    code = ("import sys\n"
            "from amp_compiler.legacy_names import loading_old_files\n"
            "with loading_old_files():\n"
            "    import passes.insert_casts as old\n"
            "from amp_compiler.passes.fx.runtime import amp_cast\n"
            "assert old.amp_cast is amp_cast\n"
            "assert 'passes' not in sys.modules and 'passes.insert_casts' not in sys.modules\n"
            "modules = {id(m): m for m in list(sys.modules.values()) if getattr(m, '__file__', '').endswith('.py')}\n"
            "files = [m.__file__ for m in modules.values()]\n"
            "assert len(files) == len(set(files)), 'a module was imported twice'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


USER_PROJECT_RUNS = {
    "import only": "import amp_compiler\nimport passes\n",
    "user's passes imported before a load": "import amp_compiler\nimport passes\nload()\n",
    "user's passes imported after a load": "import amp_compiler\nload()\nimport passes\n",
    # the user's own passes.insert_casts, already imported, must not answer the old file's passes.insert_casts
    "user's passes.insert_casts imported before a load": (
        "import amp_compiler\nimport passes, passes.insert_casts as mine\nload()\n"
        "assert sys.modules['passes.insert_casts'] is mine and passes.insert_casts is mine\n"
        "assert not hasattr(amp_compiler.passes, 'insert_casts')\ndel passes.insert_casts, sys.modules['passes.insert_casts']\n"),
}


@pytest.mark.parametrize("steps", USER_PROJECT_RUNS.values(), ids=USER_PROJECT_RUNS)
def test_a_user_projects_own_passes_package_stays_its_own(tmp_path, old_file, steps):
    """`passes` is a common package name in compiler projects: importing amp_compiler, or loading an old
    file, must never make `import passes` answer with amp_compiler.passes."""
    project = tmp_path / "project"
    (project / "passes").mkdir(parents=True)
    (project / "passes" / "__init__.py").write_text("MARKER = 'the user project'\n")
    (project / "passes" / "insert_casts.py").write_text("def amp_cast(*args):\n    return 'the user project'\n")
    folder = old_file[0]
    code = ("import sys, torch\n"
            "def load():\n"
            f"    x, expected = torch.load({str(folder / 'io.pt')!r})\n"
            f"    assert torch.equal(amp_compiler.load({str(folder / 'old.pt')!r}, weights_only=False).eval()(x), expected)\n"
            + steps +
            "assert passes.MARKER == 'the user project'\n"
            "assert not hasattr(passes, 'insert_casts') and 'passes.insert_casts' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-1500:]


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "amp_compiler").rglob("__init__.py")}
    for top_level in ("passes", "models"):     # repository folders installed inside amp_compiler
        folders |= {".".join(("amp_compiler", *p.parent.relative_to(ROOT).parts))
                    for p in (ROOT / top_level).rglob("__init__.py")}
    assert listed == folders
    assert config["package-dir"] == {"amp_compiler.passes": "passes", "amp_compiler.models": "models"}
