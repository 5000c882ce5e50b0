"""The picture's data for an ONNX model (render("model_fp16.onnx", "graph.html")), in render_view's format.

A file says what each node computes in (its output types) and which nodes are Casts, not why: the rules
come from the conversion's report when one is given (convert_onnx's rows name ONNX nodes, export_onnx's
rows name the fx nodes the exporter records as each node's last name scope). Module paths come from the
exporter's name scopes. The main graph is drawn; If/Loop/Scan bodies are not.
"""
from __future__ import annotations

import ast
import os

import onnx_ir as ir

from amp_compiler.insight.graph_decisions import connected
from amp_compiler.insight.render_view import Interned

LOW = {ir.DataType.FLOAT16: "low", ir.DataType.BFLOAT16: "low", ir.DataType.FLOAT: "fp32"}


def onnx_view(source, report=None, title: str | None = None) -> dict:
    """source: an ONNX path, an onnx_ir.Model or an onnx.ModelProto; report: an OnnxConversionReport."""
    model, name = _load(source)
    rules_by_name = {row["node"]: row["rule"] for row in getattr(report, "rows", [])}
    rules, modules = Interned(), Interned()
    unknown_rule = "no row of the report names this node" if report is not None else \
        "pass report= for the rule that chose it"
    nodes, index = [], {}

    def add(entry: dict, outputs) -> None:
        for value in outputs:
            index[value] = len(nodes)
        nodes.append(entry)

    for value in model.graph.inputs:
        add(_entry(value.name, "input", "io", "untouched", _dtype(value), "", "graph input", [], [], rules, modules),
            [value])
    initializers = set(model.graph.initializers.values())
    for node in model.graph:
        outputs = [v for v in node.outputs if v is not None]
        dtype = _dtype(outputs[0]) if outputs else "-"
        precision = "cast" if node.op_type == "Cast" else LOW.get(outputs[0].dtype if outputs else None, "untouched")
        scopes = _scopes(node)
        rule = rules_by_name.get(node.name) or rules_by_name.get(scopes[-1] if scopes else "") or \
            f"{node.op_type} with {dtype} outputs in the file ({unknown_rule})"
        inputs = [v for v in node.inputs if v is not None]
        add(_entry(node.name or node.op_type, node.op_type, "cast" if precision == "cast" else "op", precision, dtype,
                   scopes[-2] if len(scopes) >= 2 else "", rule, [index[v] for v in inputs if v in index],
                   [v.name for v in inputs if v in initializers], rules, modules), outputs)
    for value in model.graph.outputs:
        add(_entry(value.name, "output", "io", "untouched", _dtype(value), "", "graph output",
                   [index[value]] if value in index else [], [], rules, modules), [])
    islands, rule_texts = [], list(rules)
    fp32 = [i for i, n in enumerate(nodes) if n["precision"] == "fp32"]
    for members in connected(fp32, lambda i: nodes[i]["inputs"]):
        for i in members:
            nodes[i]["island"] = len(islands)
        # the first member a deny rule keeps fp32, else the first: the others follow it
        first = next((nodes[i] for i in members if rule_texts[nodes[i]["rule"]].startswith("deny")), nodes[members[0]])
        islands.append({"seed": first["name"], "rule": rule_texts[first["rule"]], "size": len(members)})
    counts = {p: sum(1 for n in nodes if n["precision"] == p) for p in ("low", "fp32", "cast")}
    summary = [f"ONNX model {name}: {len(nodes)} nodes drawn; {counts['low']} low, {counts['fp32']} fp32, "
               f"{counts['cast']} Casts; {len(islands)} fp32 islands"]
    if report is not None:
        summary = str(report).splitlines() + summary
    low = next((n["dtype"] for n in nodes if n["precision"] == "low"), "")
    return {"title": title or name, "subtitle": f"ONNX {low}".strip(), "summary": summary, "nodes": nodes,
            "islands": islands, "rules": rule_texts, "modules": list(modules)}


def _entry(name, op, kind, precision, dtype, module, rule, inputs, reads, rules, modules) -> dict:
    return {"name": name, "op": op, "kind": kind, "precision": precision, "dtype": dtype,
            "module": modules.index(module), "rule": rules.index(rule), "inputs": inputs, "reads": reads,
            "island": -1}


def _load(source) -> tuple[ir.Model, str]:
    from amp_compiler.onnx.files import load_onnx_model   # the one reader of ONNX sources (paths, protos, models)
    model = load_onnx_model(source)
    is_path = isinstance(source, (str, os.PathLike))
    return model, os.path.basename(os.fspath(source)) if is_path else model.graph.name or "model"


def _dtype(value: ir.Value) -> str:
    if value.dtype is None:
        return "-"
    return {ir.DataType.FLOAT: "float32", ir.DataType.DOUBLE: "float64"}.get(value.dtype, value.dtype.name.lower())


def _scopes(node: ir.Node) -> list[str]:
    """The exporter's name scopes, outermost first ('layers.0', 'layers.0.attention', ..., the fx node)."""
    text = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    try:
        scopes = ast.literal_eval(text) if text.startswith("[") else []
    except (ValueError, SyntaxError):
        return []
    return [str(s) for s in scopes] if isinstance(scopes, list) else []
