"""What an fp16 ONNX conversion did, as data: per-node decisions, casts, weight bytes, fp32 islands, pass
counts; printed as explain() prints a converted module (the layout is insight/report*.py's).

    amp-compiler onnx: model.onnx -> model_fp16.onnx, level O1, float16, keep_io_types=True
    nodes: 41 float16, 12 float32, 3 untouched; casts: 9 (source had 0); weights: 1.20 MB -> 0.61 MB; 0.08 s
    range calibration (4 samples): 2 nodes kept fp32: first_matmul, relu
    fp32 islands: 2, 5 nodes
      layers.[0-1].attn (x2): 2 nodes (softmax, mul); softmax: deny: exp of unbounded logits ...
    weights only moved by fp32 ops (embedding tables...): 1 stored in float16, their movers run low with one Cast up

str(): the summary; table(): one line per node, table(by_module=True) grouped by module path as explain()
groups it; to_dict()/to_json() for tools, _repr_html_ for notebooks.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import onnx_ir as ir

from amp_compiler.insight.graph_decisions import common_module, connected
from amp_compiler.insight.report import calibration_lines, island_lines
from amp_compiler.insight.report_text import module_table, wrapped
from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import cast_target, is_cast
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.runner import count

MODULE_COLUMNS = ["node", "where", "op_type", "op", "precision", "rule"]


@dataclass
class OnnxConversionReport:
    source: str
    destination: str
    level: str
    dtype: str
    keep_io_types: bool
    # node, op_type, op, precision (a dtype name, "-" untouched), rule; module, class and island (an fp32
    # island's index, -1 for none) where the conversion knows them
    rows: list[dict] = field(default_factory=list)
    casts: int = 0
    casts_in_source: int = 0
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    pass_counts: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)       # what the user should know that is not a warning
    seconds: float = 0.0
    model: Any = field(default=None, repr=False)          # the converted model, when convert_onnx wrote none

    @property
    def nodes_per_precision(self) -> dict[str, int]:
        return dict(Counter(r["precision"] for r in self.rows if r["precision"] != "-" and r["op"] != "cast"))

    @property
    def untouched(self) -> int:
        """Nodes with no float value to decide on (shapes, integer indices)."""
        return sum(1 for r in self.rows if r["precision"] == "-" and r["op"] != "cast")

    @property
    def islands(self) -> list[dict]:
        """fp32 islands (connected fp32 nodes) as explain() lists them: nodes, ops, module, seed, rule."""
        members: dict[int, list[dict]] = {}
        for row in self.rows:
            if row.get("island", -1) >= 0:
                members.setdefault(row["island"], []).append(row)
        return [_island(rows) for rows in members.values()]

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())

    def summary_lines(self) -> list[str]:
        lines = [f"amp-compiler onnx: {self.source} -> {self.destination}, level {self.level}, {self.dtype}, "
                 f"keep_io_types={self.keep_io_types}",
                 f"nodes: {self.counts()}; weights: {self.weight_bytes_before / 1e6:.2f} MB -> "
                 f"{self.weight_bytes_after / 1e6:.2f} MB; {self.seconds:.2f} s"]
        for warning in self.warnings:
            lines += wrapped("warning", [warning])
        kept = [r["node"] for r in self.rows if r["rule"].startswith("range:")]
        lines += calibration_lines(self.pass_counts.get("calibrate_ranges"), kept)
        if any("island" in r for r in self.rows):      # rows from before islands were recorded have none
            lines += island_lines(self.islands)
        moved = count(self.pass_counts, "moved_weights_stored_low")
        if moved:
            lines.append(f"weights only moved by fp32 ops (embedding tables...): {moved} stored in {self.dtype}, "
                         "their movers run low with one Cast up")
        for note in self.notes:
            lines += wrapped("note", [note])
        return lines

    def counts(self) -> str:
        per = ", ".join(f"{n} {p}" for p, n in sorted(self.nodes_per_precision.items())) or "none painted"
        return f"{per}, {self.untouched} untouched; casts: {self.casts} (source had {self.casts_in_source})"

    def table(self, by_module: bool = False) -> str:
        """One line per node: name, ONNX op type, canonical op, precision, the rule that decided; by_module:
        grouped by the torch module path the exporter recorded, repeated blocks folded (explain()'s layout)."""
        if not self.rows:
            return "(no nodes)"
        if by_module:
            rows = [{"module": "", **r} for r in self.rows]
            return "\n".join(module_table(rows, MODULE_COLUMNS))
        widths = [max(len(str(r[k])) for r in self.rows) for k in ("node", "op_type", "op", "precision")]
        return "\n".join(f"{r['node']:<{widths[0]}}  {r['op_type']:<{widths[1]}}  {r['op']:<{widths[2]}}  "
                         f"{r['precision']:<{widths[3]}}  {r['rule']}" for r in self.rows)

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    def to_json(self, **dumps) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        data.update(nodes_per_precision=self.nodes_per_precision, untouched=self.untouched, islands=self.islands)
        return json.dumps(data, default=str, **dumps)

    def _repr_html_(self) -> str:
        from amp_compiler.insight.report_html import report_html
        return report_html(self, [{"module": r.get("module", ""), "node": r["node"], "op": r["op"],
                                   "dtype": r["precision"], "rule": r["rule"], "precision": self._kind(r)}
                                  for r in self.rows])

    def _kind(self, row: dict) -> str:
        if row["op"] == "cast":
            return "cast"
        return {self.dtype: "low", "float32": "fp32"}.get(row["precision"], "untouched")


def _island(rows: list[dict]) -> dict:
    # infer/clear nodes are fp32 because of a neighbour; the first with a reason of its own seeded the island
    seed = next((r for r in rows if r.get("class") not in ("infer", "clear")), rows[0])
    # top-level nodes (no module: the graph's own adds, a residual stream) do not make the island's place
    modules = [r["module"] for r in rows if r.get("module")] or [""]
    where = common_module(modules) or (modules[0] if modules[0] == modules[-1] else f"{modules[0]} through {modules[-1]}")
    return {"nodes": [r["node"] for r in rows], "ops": [r["op"] for r in rows], "module": where,
            "seed": seed["node"], "rule": seed["rule"]}


def decision_rows(model: ir.Model, low_name: str) -> list[dict]:
    """Rows from node.meta["amp"] (written by decide_onnx_precision); casts are listed with their dtype, under
    the module of the node they feed."""
    rows, fp32 = [], []
    for node in all_nodes(model.graph):
        amp = node.meta.get("amp")
        if is_cast(node):
            rule = amp["rule"] if amp else "precision boundary"
            rows.append({"node": node.name, "op_type": node.op_type, "op": "cast",
                         "precision": dtype_name(cast_target(node)), "rule": rule,
                         "module": _cast_module(node), "class": "cast", "island": -1})
            continue
        if amp is None:
            continue
        precision = {"low": low_name, "fp32": "float32"}.get(amp.get("precision"), "-")
        rows.append({"node": node.name, "op_type": node.op_type, "op": amp["op"], "precision": precision,
                     "rule": amp.get("rule", ""), "module": amp.get("module", ""), "class": amp.get("class", "-"),
                     "island": -1})
        if precision == "float32":
            fp32.append((node, rows[-1]))
    row_of = {node: row for node, row in fp32}
    producers = lambda node: [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
    for index, island in enumerate(connected(list(row_of), producers)):
        for node in island:
            row_of[node]["island"] = index
    return rows


def _cast_module(node: ir.Node) -> str:
    """A cast inserted by the conversion has no module: it goes with the node it feeds (else its producer)."""
    neighbours = [user for value in node.outputs for user, _ in value.uses()]
    neighbours += [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
    return next((n.meta["amp"].get("module", "") for n in neighbours if n.meta.get("amp", {}).get("module")), "")


def count_casts(model: ir.Model) -> int:
    return sum(1 for node in all_nodes(model.graph) if is_cast(node))
