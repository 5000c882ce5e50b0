"""The project's own import graph, read from the source (function-local imports included): no circle, no
private name imported from another module, passes/ never importing the rest of the package."""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("amp_compiler",)


def _modules() -> dict[str, Path]:
    """Installed module name -> file: passes/ and models/ install as amp_compiler.passes and .models (pyproject.toml)."""
    found = {}
    for top, prefix in (("amp_compiler", "amp_compiler"), ("passes", "amp_compiler.passes"), ("models", "amp_compiler.models")):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) of every project import in the file, wherever it is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names if alias.name.startswith(PROJECT)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if not base.startswith(PROJECT):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, "", node.lineno) if submodule in modules else (base, alias.name, node.lineno))
    return found


MODULES = _modules()
EDGES = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name, imports in EDGES.items():
        for target, _, _ in imports:
            while target not in MODULES and "." in target:   # `import a.b.c` of a package: its module
                target = target.rpartition(".")[0]
            if target != name and target in MODULES:
                graph.add_edge(name, target)
    return graph


def test_the_import_graph_has_no_circle():
    circles = [sorted(component) for component in nx.strongly_connected_components(_graph()) if len(component) > 1]
    assert not circles, f"modules that import each other (through function-local imports too): {circles}"


def test_no_module_imports_another_modules_private_name():
    private = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {imported} from {target}"
               for name, imports in EDGES.items() for target, imported, line in imports
               if imported.startswith("_") and not imported.startswith("__") and target != name]
    assert not private, "\n".join(private)


def test_passes_import_nothing_of_the_package_but_passes():
    outside = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
               for name, imports in EDGES.items() if name.startswith("amp_compiler.passes")
               for target, _, line in imports if not target.startswith("amp_compiler.passes")]
    assert not outside, "\n".join(outside)


def test_the_checks_see_the_imports_they_judge():
    """The reader resolves relative and function-local imports, and the package's own layering is visible."""
    graph = _graph()
    assert graph.has_edge("amp_compiler.convert_model", "amp_compiler.dynamo.compile")   # convert(inplace=True)
    assert graph.has_edge("amp_compiler.dynamo.backend", "amp_compiler.graph_conversion")
    assert graph.has_edge("amp_compiler.insight.report", "amp_compiler.converted")
    assert not nx.has_path(graph, "amp_compiler.insight.report", "amp_compiler.dynamo.compile")   # the seam
    assert len(MODULES) > 100 and sum(len(imports) for imports in EDGES.values()) > 500


def _reachable(start: str) -> set[str]:
    graph = _graph()
    return {start} | nx.descendants(graph, start)


def _imports_torch(name: str) -> bool:
    """The module imports torch itself (at its top or inside a function)."""
    for node in ast.walk(ast.parse(MODULES[name].read_text(), str(MODULES[name]))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_the_policy_and_the_onnx_passes_reach_no_fx_pass():
    """policy/ is IR-neutral and onnx/ is the other IR: neither imports passes/fx, however indirectly."""
    leaks = [f"{name} reaches {sorted(m for m in _reachable(name) if m.startswith('amp_compiler.passes.fx'))}"
             for name in MODULES if name.startswith(("amp_compiler.passes.policy", "amp_compiler.passes.onnx"))
             and any(m.startswith("amp_compiler.passes.fx") for m in _reachable(name))]
    assert not leaks, "\n".join(leaks)


# Modules every ONNX pass reaches that still import torch themselves: node_facts (for one annotation) and
# policy/numerics (torch.finfo, dtype_name's isinstance, the fx passes' module-type sets). Not the fp8 pass's own.
TORCH_SHARED_WITH_EVERY_ONNX_PASS = {"amp_compiler.passes.node_facts", "amp_compiler.passes.policy.numerics"}


def test_the_onnx_fp8_pass_and_the_fp8_policy_import_no_torch():
    """The fp8 facts both IRs share (policy/fp8.py: formats, scale rule, options) are plain Python, and the ONNX
    fp8 pass computes its weights' float8 codes with numpy: neither reaches torch but through the shared two."""
    for start in ("amp_compiler.passes.onnx.lower_fp8_matmuls", "amp_compiler.passes.policy.fp8",
                  "amp_compiler.passes.policy.rules"):
        importing = sorted(m for m in _reachable(start) if _imports_torch(m))
        assert set(importing) <= TORCH_SHARED_WITH_EVERY_ONNX_PASS, f"{start} reaches torch through {importing}"
    assert not any(_imports_torch(m) for m in _reachable("amp_compiler.passes.policy.fp8"))
