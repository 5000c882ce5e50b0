"""The picture's data: a converted graph as plain lists, the same for fx and ONNX sources.

    {"title": ..., "summary": [lines], "rules": [text], "modules": [path],
     "nodes": [{"name", "op", "kind": "op"|"cast"|"io"|"opaque", "precision": "low"|"fp32"|"cast"|"untouched",
                "dtype", "module": index, "rule": index, "inputs": [node index], "island": index or -1,
                "reads": [parameter names]}],
     "islands": [{"seed", "rule", "size"}]}

Every fx node but get_attr is a node of the picture (a parameter shows in the tooltip of the node that
reads it). Rule and module texts repeat across a large graph, so nodes refer to them by index.
"""
from __future__ import annotations


import torch.fx as fx

from amp_compiler.converted import converted_graphs
from amp_compiler.insight.graph_decisions import computed_dtype, fp32_islands, graph_summary, module_of, precision_of
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name

IO_OPS = ("placeholder", "output")


class Interned(dict):
    """text -> index, in first-seen order."""

    def index(self, text: str) -> int:
        return self.setdefault(text, len(self))


def fx_view(module, title: str | None = None) -> dict:
    """The view of a module returned by convert() (a model run as written: each converted child)."""
    from amp_compiler.insight.report import converted_model_in, explain
    module = converted_model_in(module)   # a wrapper (peft) holds the converted model, as explain() reads it
    report = explain(module)
    summary = report.summary   # a model converted in place has no summary of its own
    rules, modules = Interned(), Interned()
    view = {"title": title or type(module).__name__.removesuffix("Amp"), "summary": report.summary_lines(),
            "subtitle": f"{summary['level']} {summary['dtype']}", "nodes": [], "islands": []}
    for prefix, gm in converted_graphs(module):   # in place: every graph made so far (none before a call)
        _add_graph(view, gm, graph_summary(gm)["dtype"], prefix, rules, modules)
    view["rules"], view["modules"] = list(rules), list(modules)
    return view


def _add_graph(view: dict, gm: fx.GraphModule, low: str, prefix: str, rules: Interned, modules: Interned):
    index: dict[fx.Node, int] = {}
    island_of = {}
    for island in fp32_islands(gm):
        for name in island.nodes:
            island_of[name] = len(view["islands"])
        view["islands"].append({"seed": island.seed, "rule": island.rule, "size": len(island.nodes)})
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        amp = facts(node)
        precision = precision_of(node)
        kind = "io" if node.op in IO_OPS else "cast" if precision == "cast" else \
            "opaque" if amp.get("family") == "opaque" else "op"
        module = ".".join(p for p in (prefix, module_of(node)) if p)
        index[node] = len(view["nodes"])
        view["nodes"].append({
            "name": node.name, "op": "input" if node.op == "placeholder" else node.op if kind == "io" else
            amp.get("op", str(node.target)), "kind": kind, "precision": precision,
            "dtype": computed_dtype(node, low) if kind != "io" else dtype_name(amp.get("dtype")),
            "module": modules.index(module), "rule": rules.index(amp.get("rule", "")),
            "inputs": [index[source] for source in node.all_input_nodes if source in index],
            "reads": [str(source.target) for source in node.all_input_nodes if source.op == "get_attr"],
            "island": island_of.get(node.name, -1)})
