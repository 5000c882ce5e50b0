"""explain(gm): a view of the decisions the passes wrote into node.meta["amp"], nothing recomputed.

    node     module      op      dtype    rule
    linear   encoder.fc  linear  float16  allow: dense matmul: tensor-core throughput, ...
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx

from passes.infer_dtypes import dtype_name
from passes.insert_casts import is_cast


@dataclass
class PrecisionReport:
    rows: list[dict]
    totals: dict
    summary: dict = field(default_factory=dict)

    def __str__(self) -> str:
        s = self.summary
        lines = [f"amp-compiler: level {s.get('level')} (asked {s.get('requested_level')}), low dtype "
                 f"{s.get('dtype')}, front end {s.get('frontend')}"]
        if s.get("leaf_modules"):
            lines.append(f"leaf modules kept whole: {', '.join(s['leaf_modules'])}")
        lines += [f"note: {note}" for note in s.get("notes", [])]
        columns = ("node", "module", "op", "dtype")
        widths = {c: max([len(str(r[c])) for r in self.rows] + [len(c)]) for c in columns}
        lines.append("  ".join(f"{c:<{widths[c]}}" for c in columns) + "  rule")
        for r in self.rows:
            lines.append("  ".join(f"{str(r[c]):<{widths[c]}}" for c in columns) + f"  {r['rule']}")
        t = self.totals
        per_dtype = ", ".join(f"{k}: {v}" for k, v in sorted(t["nodes_per_dtype"].items()))
        lines.append(f"totals: {t['nodes']} compute nodes ({per_dtype}); {t['casts']} casts; "
                     f"{len(t['unknown_ops'])} unknown ops{': ' + ', '.join(t['unknown_ops']) if t['unknown_ops'] else ''}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "totals": self.totals, "summary": self.summary}


def explain(gm: fx.GraphModule) -> PrecisionReport:
    """Per-node report of a converted GraphModule: node, canonical op, dtype, the rule that decided it."""
    if "amp" not in getattr(gm, "meta", {}):
        raise ValueError("explain() needs a GraphModule returned by amp_compiler.convert()")
    if "children" in gm.meta["amp"]:
        return _explain_children(gm)
    low = gm.meta["amp"]["dtype"]
    rows, per_dtype, unknown = [], Counter(), []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        amp = node.meta.get("amp", {})
        precision = amp.get("precision")
        if is_cast(node):
            dtype = dtype_name(node.args[1])
        else:
            dtype = {"low": low, "fp32": "float32"}.get(precision, "-")
            if precision is not None:
                per_dtype[dtype] += 1
        if amp.get("family") == "unknown" and amp.get("op") not in unknown:
            unknown.append(amp.get("op"))
        rows.append({"node": node.name, "op": amp.get("op", "?"), "class": amp.get("class", "-"),
                     "module": amp.get("module", ""), "dtype": dtype, "rule": amp.get("rule", "")})
    totals = {"nodes": sum(per_dtype.values()), "nodes_per_dtype": dict(per_dtype),
              "casts": sum(1 for n in gm.graph.nodes if is_cast(n)), "unknown_ops": unknown}
    return PrecisionReport(rows, totals, dict(gm.meta["amp"]))


def _explain_children(module) -> PrecisionReport:
    """A model whose own forward runs as written: the reports of its converted children, one table."""
    rows, per_dtype, unknown, casts = [], Counter(), [], 0
    for name in module.meta["amp"]["children"]:
        child = explain(module.get_submodule(name))
        rows += [{**row, "module": f"{name}.{row['module']}" if row["module"] else name} for row in child.rows]
        per_dtype.update(child.totals["nodes_per_dtype"])
        unknown += [op for op in child.totals["unknown_ops"] if op not in unknown]
        casts += child.totals["casts"]
    totals = {"nodes": sum(per_dtype.values()), "nodes_per_dtype": dict(per_dtype), "casts": casts,
              "unknown_ops": unknown}
    return PrecisionReport(rows, totals, dict(module.meta["amp"]))
