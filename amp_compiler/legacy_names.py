"""The previous release's module names, kept importable for one release.

A GraphModule saved with torch.save keeps its generated code, whose import lines name the helpers by
module path (`from passes.insert_casts import amp_cast`). Those paths moved under amp_compiler.passes;
this finder answers exactly the old names with the modules that now hold the same objects, so old files
load and no module is ever imported twice under two names (the passes test `node.target is amp_cast`).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD_PASS_MODULES = (
    "canonicalize", "cast_after_layout_ops", "decide_fx_precision", "decide_onnx_precision", "fold_casts",
    "fold_onnx_casts", "graph_leaf", "infer_dtypes", "infer_onnx_types", "insert_casts", "insert_onnx_casts",
    "lower_leaf_modules", "lower_onnx_graph_inputs", "onnx_canonicalize", "onnx_cast_nodes", "onnx_dtype_rules",
    "op_policy", "opaque_calls", "paint_precision", "pass_result", "propagate_values", "rules",
    "store_moved_onnx_weights_low", "strip_onnx_float_casts", "unify_onnx_input_types", "unique_onnx_names",
    "widen_refused_onnx_nodes",
)
# old module name -> the module that now answers for it
RENAMED = {"passes": "amp_compiler.passes",
           **{f"passes.{name}": f"amp_compiler.passes.{name}" for name in OLD_PASS_MODULES}}


class _RenamedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in RENAMED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds for the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(RENAMED[module.__name__])


def install() -> None:
    if not any(isinstance(finder, _RenamedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RenamedModules())   # ahead of a source checkout's top-level passes/
