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
    assert graph.has_edge("amp_compiler.convert", "amp_compiler.dynamo.compile")   # convert(inplace=True)
    assert graph.has_edge("amp_compiler.dynamo.backend", "amp_compiler.graph_conversion")
    assert graph.has_edge("amp_compiler.insight.report", "amp_compiler.converted")
    assert not nx.has_path(graph, "amp_compiler.insight.report", "amp_compiler.dynamo.compile")   # the seam
    assert len(MODULES) > 100 and sum(len(imports) for imports in EDGES.values()) > 500
