"""The decisions a converted graph carries, read back from node.meta only.

The passes write facts(node) (op, class, rule, precision "low"/"fp32"/None, dtype) on every node
and node.meta["amp_role"] = "cast" on the casts they insert; convert() writes gm.meta["amp"]. The
report, the picture and compare() all read that record through this module, and import no pass, so
they keep working whatever the passes become.

`graph_summary(gm)` (saved_decisions.py) gives gm.meta["amp"], also on a module that went through
torch.save/torch.load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.saved_decisions import graph_summary  # noqa: F401 (the readers of this module use it)


def is_cast(node: fx.Node) -> bool:
    return node.meta.get("amp_role") == "cast"


def is_shown(node: fx.Node) -> bool:
    """Nodes a report lists: computations and casts, not inputs, parameters or the output."""
    return node.op not in ("placeholder", "get_attr", "output")


def precision_of(node: fx.Node) -> str:
    """"low", "fp32", "cast" or "untouched" (no float value to decide on: shapes, ints, lookups)."""
    if is_cast(node):
        return "cast"
    return facts(node).get("precision") or "untouched"


def computed_dtype(node: fx.Node, low: str) -> str:
    """The dtype a node computes in, as the report prints it ("-" where untouched)."""
    amp = facts(node)
    if is_cast(node):
        return dtype_name(amp.get("dtype"))
    return {"low": low, "fp32": "float32"}.get(amp.get("precision"), "-")


def weight_cast_of(node: fx.Node, graph_inputs: dict) -> str | None:
    """The parameter or buffer a cast makes a copy of ("blocks.0.fc.weight"), None for a cast of an activation.
    `graph_inputs`: gm.meta["amp"]["graph_inputs"] of a graph that takes its weights as inputs (dynamo's)."""
    if not is_cast(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    if source.op == "get_attr":
        return str(source.target)
    info = graph_inputs.get(source.name, {}) if source.op == "placeholder" else {}
    return info.get("name") if info.get("kind") in ("parameter", "buffer") else None


def module_of(node: fx.Node) -> str:
    """The module path a node belongs to; a weight cast (no module of its own) goes with its reader."""
    module = facts(node).get("module") or ""      # O0 graphs record none
    if not module and is_cast(node):
        for user in node.users:
            return module_of(user)
    return module


@dataclass
class Island:
    """Connected fp32 nodes: where a low-precision graph keeps full precision, and why."""
    nodes: list[str]
    ops: list[str]
    module: str          # the deepest module path all its nodes share, else "first through last" module
    seed: str            # the node whose own rule keeps it fp32 (the others follow it)
    rule: str

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "ops": self.ops, "module": self.module, "seed": self.seed, "rule": self.rule}


def fp32_islands(gm: fx.GraphModule) -> list[Island]:
    """fp32 nodes joined by fp32 -> fp32 edges, in graph order."""
    fp32 = [node for node in gm.graph.nodes if precision_of(node) == "fp32"]
    return [_island(group) for group in connected(fp32, lambda node: node.all_input_nodes)]


def connected(items: list, inputs_of) -> list[list]:
    """The groups of `items` joined by edges inputs_of(item) -> item between items; items in their order."""
    parent = {item: item for item in items}

    def root(item):
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for item in items:
        for source in inputs_of(item):
            if source in parent:
                parent[root(source)] = root(item)
    groups: dict = {}
    for item in items:
        groups.setdefault(root(item), []).append(item)
    return list(groups.values())


def _island(nodes: list[fx.Node]) -> Island:
    amp = [facts(node) for node in nodes]
    # infer/clear nodes are fp32 because of a neighbour; the first node with a reason of its own seeded it
    seed = next((i for i, a in enumerate(amp) if a.get("class") not in ("infer", "clear")), 0)
    modules = [module_of(n) for n in nodes]
    where = common_module(modules) or (modules[0] if modules[0] == modules[-1] else f"{modules[0]} through {modules[-1]}")
    return Island([n.name for n in nodes], [a.get("op", "?") for a in amp], where, nodes[seed].name,
                  amp[seed].get("rule", ""))


def common_module(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    shared = []
    for components in zip(*parts):
        if len(set(components)) > 1:
            break
        shared.append(components[0])
    return ".".join(shared)
