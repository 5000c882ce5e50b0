"""What an fp16 ONNX conversion did, as data: per-node decisions, casts, weight bytes, pass counts.

    amp-compiler onnx: model.onnx -> model_fp16.onnx, level O1, float16, keep_io_types=True
    nodes: 41 float16, 12 float32; casts: 9 (source had 0); weights: 1.20 MB -> 0.61 MB; 0.08 s
    weights only moved by fp32 ops (embedding tables...): 1 stored in float16, their movers run low with one Cast up
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import cast_target, dtype_name, is_cast
from amp_compiler.passes.runner import count


@dataclass
class OnnxConversionReport:
    source: str
    destination: str
    level: str
    dtype: str
    keep_io_types: bool
    rows: list[dict] = field(default_factory=list)      # node, op_type, op, precision, rule
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

    def __str__(self) -> str:
        per = ", ".join(f"{n} {p}" for p, n in sorted(self.nodes_per_precision.items())) or "none painted"
        lines = [f"amp-compiler onnx: {self.source} -> {self.destination}, level {self.level}, {self.dtype}, "
                 f"keep_io_types={self.keep_io_types}",
                 f"nodes: {per}; casts: {self.casts} (source had {self.casts_in_source}); weights: "
                 f"{self.weight_bytes_before / 1e6:.2f} MB -> {self.weight_bytes_after / 1e6:.2f} MB; "
                 f"{self.seconds:.2f} s"]
        moved = count(self.pass_counts, "moved_weights_stored_low")
        if moved:
            lines.append(f"weights only moved by fp32 ops (embedding tables...): {moved} stored in {self.dtype}, "
                         "their movers run low with one Cast up")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def table(self) -> str:
        """One line per node: name, ONNX op type, canonical op, precision, the rule that decided."""
        if not self.rows:
            return "(no nodes)"
        widths = [max(len(str(r[k])) for r in self.rows) for k in ("node", "op_type", "op", "precision")]
        return "\n".join(f"{r['node']:<{widths[0]}}  {r['op_type']:<{widths[1]}}  {r['op']:<{widths[2]}}  "
                         f"{r['precision']:<{widths[3]}}  {r['rule']}" for r in self.rows)


def decision_rows(model: ir.Model, low_name: str) -> list[dict]:
    """Rows from node.meta["amp"] (written by decide_onnx_precision); casts are listed with their dtype."""
    rows = []
    for node in all_nodes(model.graph):
        amp = node.meta.get("amp")
        if is_cast(node):
            precision = dtype_name(cast_target(node))
            rows.append({"node": node.name, "op_type": node.op_type, "op": "cast", "precision": precision,
                         "rule": amp["rule"] if amp else "precision boundary"})
            continue
        if amp is None:
            continue
        precision = {"low": low_name, "fp32": "float32"}.get(amp.get("precision"), "-")
        rows.append({"node": node.name, "op_type": node.op_type, "op": amp["op"], "precision": precision,
                     "rule": amp.get("rule", "")})
    return rows


def count_casts(model: ir.Model) -> int:
    return sum(1 for node in all_nodes(model.graph) if is_cast(node))
