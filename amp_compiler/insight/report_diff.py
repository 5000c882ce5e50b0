"""diff_reports(old, new): what a change of level, dtype or rule changed, node by node, from two
explain() reports (diff(before, after) in report.py explains two modules and calls it).

    diff: O1 float16 -> O2 float16
    before: 85 float16, 31 float32, 20 untouched; 75 casts; 0 unknown ops
    after:  112 float16, 4 float32, 20 untouched; 41 casts; 0 unknown ops
    27 nodes changed dtype, by module: node, where, op, before -> after, rule now
    layers.0
      add_1  add  float32 -> float16  infer: between low-precision ops

Nodes are matched by name: two conversions of one model trace the same nodes (casts are not matched;
their counts are compared).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape

from amp_compiler.insight.report_text import module_table

DIFF_COLUMNS = ["node", "where", "op", "change", "rule"]


@dataclass
class PrecisionDiff:
    before: dict                 # level, dtype and counts of each side
    after: dict
    rows: list[dict]             # node, module, op, before, after, change, rule (the rule now)
    rule_only: list[str] = field(default_factory=list)     # same dtype, another rule
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    leaf_modules: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        b, a = self.before, self.after
        lines = [f"diff: {b['level']} {b['dtype']} -> {a['level']} {a['dtype']}",
                 f"before: {b['counts']}", f"after:  {a['counts']}"]
        if self.only_before or self.only_after:
            lines.append(f"nodes only before: {len(self.only_before)}, only after: {len(self.only_after)} "
                         "(traced differently)")
        if self.rule_only:
            lines.append(f"{len(self.rule_only)} nodes kept their dtype under another rule")
        if not self.rows:
            return "\n".join(lines + ["no node changed dtype"])
        lines.append(f"{len(self.rows)} nodes changed dtype, by module: node, where, op, before -> after, rule now")
        return "\n".join(lines + module_table(self.rows, DIFF_COLUMNS, self.leaf_modules))

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    def to_json(self, **dumps) -> str:
        return json.dumps({"before": self.before, "after": self.after, "rows": self.rows, "rule_only": self.rule_only,
                           "only_before": self.only_before, "only_after": self.only_after}, default=str, **dumps)

    def _repr_html_(self) -> str:
        return f"<pre>{escape(str(self))}</pre>"


def diff_reports(old, new) -> PrecisionDiff:
    """Node-by-node changes between two explain() reports of one model (this module reads reports only,
    so report.py can build a diff without a circular import)."""
    old_rows = {r["node"]: r for r in old.rows if r["precision"] != "cast"}
    new_rows = {r["node"]: r for r in new.rows if r["precision"] != "cast"}
    rows, rule_only = [], []
    for name, now in new_rows.items():
        was = old_rows.get(name)
        if was is None:
            continue
        if was["dtype"] != now["dtype"]:
            rows.append({"node": name, "module": now["module"], "op": now["op"], "before": was["dtype"],
                         "after": now["dtype"], "change": f"{was['dtype']} -> {now['dtype']}", "rule": now["rule"]})
        elif was["rule"] != now["rule"]:
            rule_only.append(name)
    return PrecisionDiff(_side(old), _side(new), rows, rule_only,
                         [n for n in old_rows if n not in new_rows], [n for n in new_rows if n not in old_rows],
                         list(new.summary.get("leaf_modules", [])))


def _side(report) -> dict:
    return {"level": report.summary.get("level"), "dtype": report.summary.get("dtype"), "counts": report.counts(),
            "casts": report.totals["casts"], "nodes_per_dtype": report.totals["nodes_per_dtype"]}
