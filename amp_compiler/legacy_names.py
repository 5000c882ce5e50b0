"""The previous release's module names, kept importable for one release.

A GraphModule saved with torch.save keeps its generated code, whose import lines name the helpers by
module path (`from passes.insert_casts import amp_cast`), and pickled objects name their classes'
modules (amp_compiler.loss_scale.DynamicLossScaleManager). Those modules moved (amp_compiler.passes.fx...);
a finder answers exactly the old names with the modules that now hold the same objects, so old files
load and no module is ever imported twice under two names (the passes test `node.target is amp_cast`).

Old names inside our own namespace (`amp_compiler.loss_scale`) are answered always: nobody else can own
them. The old top-level names (`passes`, `passes.*`) belong to whoever has a `passes` package (a common
name in compiler projects), so they are answered only while an old file loads:

    gm = amp_compiler.load("converted.pt", weights_only=False)      # torch.load, with the old names
    with amp_compiler.legacy_names.loading_old_files():              # or around any loader
        gm = torch.load("converted.pt", weights_only=False)

Afterwards `import passes` finds the user's package again. The loaded module's code names the new
paths, so saving it again writes a file that loads without either. The finder is global while it is
installed: load old files from one thread at a time.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys

# old module name -> the module that now answers for it. Not here: amp_compiler.train (now the package
# that re-exports the old module's names), and amp_compiler.render/compare/verify, whose old module names
# are the public functions of the same name.
RENAMED = {
    "passes": "amp_compiler.passes",
    "passes.pass_result": "amp_compiler.passes.runner",
    "passes.op_policy": "amp_compiler.passes.policy.op_policy",
    "passes.rules": "amp_compiler.passes.policy.rules",
    "passes.paint_precision": "amp_compiler.passes.painting.paint_precision",
    "passes.graph_leaf": "amp_compiler.passes.fx.runtime",
    "passes.canonicalize": "amp_compiler.passes.fx.canonicalize",
    "passes.propagate_values": "amp_compiler.passes.fx.propagate_values",
    "passes.infer_dtypes": "amp_compiler.passes.fx.infer_dtypes",
    "passes.decide_fx_precision": "amp_compiler.passes.fx.decide_precision",
    "passes.opaque_calls": "amp_compiler.passes.fx.opaque_calls",
    "passes.lower_leaf_modules": "amp_compiler.passes.fx.lower_leaf_modules",
    "passes.insert_casts": "amp_compiler.passes.fx.insert_casts",
    "passes.fold_casts": "amp_compiler.passes.fx.fold_casts",
    "passes.cast_after_layout_ops": "amp_compiler.passes.fx.cast_after_layout_ops",
    "passes.onnx_canonicalize": "amp_compiler.passes.onnx.canonicalize",
    "passes.infer_onnx_types": "amp_compiler.passes.onnx.infer_types",
    "passes.strip_onnx_float_casts": "amp_compiler.passes.onnx.strip_float_casts",
    "passes.decide_onnx_precision": "amp_compiler.passes.onnx.decide_precision",
    "passes.store_moved_onnx_weights_low": "amp_compiler.passes.onnx.store_moved_weights_low",
    "passes.insert_onnx_casts": "amp_compiler.passes.onnx.insert_casts",
    "passes.fold_onnx_casts": "amp_compiler.passes.onnx.fold_casts",
    "passes.lower_onnx_graph_inputs": "amp_compiler.passes.onnx.lower_graph_inputs",
    "passes.unique_onnx_names": "amp_compiler.passes.onnx.unique_names",
    "passes.unify_onnx_input_types": "amp_compiler.passes.onnx.unify_input_types",
    "passes.widen_refused_onnx_nodes": "amp_compiler.passes.onnx.widen_refused_nodes",
    "passes.onnx_cast_nodes": "amp_compiler.passes.onnx.cast_nodes",
    "passes.onnx_dtype_rules": "amp_compiler.passes.onnx.spec",
    "amp_compiler.joint_graph": "amp_compiler.train.joint_graph",
    "amp_compiler.loss_scale": "amp_compiler.train.loss_scale",
    "amp_compiler.grad_scaler": "amp_compiler.train.grad_scaler",
    "amp_compiler.bad_steps": "amp_compiler.train.bad_steps",
    "amp_compiler.plain_loop": "amp_compiler.train.plain_loop",
    "amp_compiler.step_outcome": "amp_compiler.train.step_outcome",
    "amp_compiler.train_checks": "amp_compiler.train.train_checks",
    "amp_compiler.onnx_cli": "amp_compiler.cli.onnx_commands",
    "amp_compiler.onnx.cli": "amp_compiler.cli.onnx_commands",
    "amp_compiler.onnx_convert": "amp_compiler.onnx.convert",
    "amp_compiler.onnx_export": "amp_compiler.onnx.export",
    "amp_compiler.onnx_files": "amp_compiler.onnx.files",
    "amp_compiler.onnx_report": "amp_compiler.onnx.report",
    "amp_compiler.onnx_sessions": "amp_compiler.onnx.sessions",
    "amp_compiler.onnx_validate": "amp_compiler.onnx.validate",
    "amp_compiler.report": "amp_compiler.insight.report",
    "amp_compiler.report_diff": "amp_compiler.insight.report_diff",
    "amp_compiler.report_html": "amp_compiler.insight.report_html",
    "amp_compiler.report_text": "amp_compiler.insight.report_text",
    "amp_compiler.render_onnx_view": "amp_compiler.insight.render_onnx_view",
    "amp_compiler.render_page": "amp_compiler.insight.render_page",
    "amp_compiler.render_script": "amp_compiler.insight.render_script",
    "amp_compiler.render_view": "amp_compiler.insight.render_view",
    "amp_compiler.graph_decisions": "amp_compiler.insight.graph_decisions",
}


# The old names outside amp_compiler's namespace: answered only inside loading_old_files().
TOP_LEVEL = "passes"


def _is_top_level_old_name(name: str) -> bool:
    return name == TOP_LEVEL or name.startswith(TOP_LEVEL + ".")


class _RenamedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the old names in `names` with the modules that hold their objects now."""

    def __init__(self, names) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.names else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds for the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(RENAMED[module.__name__])


class _OwnOldNames(_RenamedModules):
    """The permanent finder: old names under amp_compiler only."""

    def __init__(self) -> None:
        super().__init__(name for name in RENAMED if not _is_top_level_old_name(name))


def install() -> None:
    """Answer the old amp_compiler.* names from now on (`import amp_compiler` does this)."""
    if not any(isinstance(finder, _OwnOldNames) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OwnOldNames())   # ahead of any stale file left under an old name


@contextlib.contextmanager
def loading_old_files():
    """While the block runs, the previous release's top-level names (`passes.insert_casts`...) import
    as the modules now holding their objects; afterwards every `passes` name is as it was before."""
    before = {name: module for name, module in sys.modules.items() if _is_top_level_old_name(name)}
    for name in before:   # a user's own passes.x already imported must not answer an old file's passes.x
        del sys.modules[name]
    finder = _RenamedModules(name for name in RENAMED if _is_top_level_old_name(name))
    sys.meta_path.insert(0, finder)   # ahead of a source checkout's or the user's own passes/
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        _restore_modules(before)


def _restore_modules(before: dict) -> None:
    during = {name: module for name, module in sys.modules.items() if _is_top_level_old_name(name)}
    for name, module in during.items():
        parent, _, child = name.rpartition(".")
        holder = during.get(parent)   # importing passes.x set x on what `passes` named then: ours, not its name
        if holder is not None and getattr(holder, child, None) is module \
                and module.__name__ != f"{holder.__name__}.{child}":
            delattr(holder, child)
    for name in during:
        module = sys.modules.pop(name)
        parent, _, child = name.rpartition(".")
        # Importing passes.x under the finder set x on a `passes` the user had imported: take it back.
        if parent in before and getattr(before[parent], child, None) is module:
            delattr(before[parent], child)
    sys.modules.update(before)


def load(f, **torch_load_arguments):
    """`torch.load(f, **torch_load_arguments)` inside loading_old_files(): for files saved by the
    previous release. A converted GraphModule is a pickle: pass weights_only=False for files you trust."""
    import torch

    with loading_old_files():
        return torch.load(f, **torch_load_arguments)
