"""Files saved by the previous release name helpers by old module paths (passes.insert_casts.amp_cast...):
they keep loading, and no module is ever imported under two names."""
import importlib
import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

import amp_compiler
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
    for name, old in OLD_HOMES.items():
        assert getattr(importlib.import_module(old), name) is getattr(runtime, name)
    assert importlib.import_module("passes") is importlib.import_module("amp_compiler.passes")
    old_manager = importlib.import_module("amp_compiler.loss_scale").DynamicLossScaleManager
    assert old_manager is amp_compiler.DynamicLossScaleManager   # pickled managers name the old module


def test_a_graph_module_saved_with_the_old_module_paths_loads():
    model, x = GruNet(), torch.randn(2, 3, 4)
    gm = amp_compiler.convert(model, "O3", example_inputs=(x,), dtype=torch.bfloat16)
    old = _OldFile(gm)
    assert "from passes.insert_casts import amp_cast" in old.import_block
    assert "from passes.lower_leaf_modules import amp_module_call" in old.import_block
    buffer = io.BytesIO()
    torch.save(old, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.eval(), gm.eval()
    assert torch.equal(loaded(x), gm(x))
    helpers = {n.target.__name__ for n in loaded.graph.nodes if n.op == "call_function"}
    assert {"amp_cast", "amp_module_call"} <= helpers   # still one node each, not traced through


def test_old_names_load_in_a_fresh_interpreter_from_a_source_checkout():
    # From the repository root a plain `import passes` finds the folder itself: it must answer with
    # amp_compiler.passes, never load the pass modules a second time.
    code = ("import sys, passes.insert_casts as old\n"
            "from amp_compiler.passes.fx.runtime import amp_cast\n"
            "assert old.amp_cast is amp_cast\n"
            "assert sys.modules['passes'] is sys.modules['amp_compiler.passes']\n"
            "modules = {id(m): m for m in list(sys.modules.values()) if getattr(m, '__file__', '').endswith('.py')}\n"
            "files = [m.__file__ for m in modules.values()]\n"
            "assert len(files) == len(set(files)), 'a module was imported twice'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "amp_compiler").rglob("__init__.py")}
    for top_level in ("passes", "models"):     # repository folders installed inside amp_compiler
        folders |= {".".join(("amp_compiler", *p.parent.relative_to(ROOT).parts))
                    for p in (ROOT / top_level).rglob("__init__.py")}
    assert listed == folders
    assert config["package-dir"] == {"amp_compiler.passes": "passes", "amp_compiler.models": "models"}
