"""explain(gm): what convert() decided and why, read from node.meta (nothing recomputed).

    amp-compiler report: level O1 (asked O1), float16, front end fx.symbolic_trace
    nodes: 98 float16, 45 float32, 40 untouched (no float value to decide on: integers, shapes, lookups); ...
    fp32 islands (connected nodes kept float32): 9, 45 nodes
      layers.[0-3].attention (x4): 3 nodes (mul, masked_fill, softmax); softmax: deny: exp of unbounded ...
    52 of 209 rows: the decisions (ops a rule sets low or fp32, casts of activations, every fp32 node) ...
    layers.0.attention
      linear  query  linear  float16  allow: dense matmul ...
    layers.1 through layers.3: same decisions as layers.0 (3 blocks of 13 rows)

str(report) lists the decisions; explain(gm, full=True) every row (the nodes that only follow their
neighbours, untouched bookkeeping, weight casts). explain(gm, only="fp32", module="encoder.*", op="softmax")
filters the rows (the summary stays whole) and lists every row it keeps; explain(before, after) is
diff(before, after). str() for terminals, _repr_html_ for notebooks, to_dict()/to_json() for tools
(report.rows always holds every row).
"""
from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from amp_compiler.insight.graph_decisions import (computed_dtype, fp32_islands, graph_summary, is_cast, is_shown,
                                                  module_of, precision_of, weight_cast_of)
from amp_compiler.frontend.hooks import hook_lines
from amp_compiler.converted import ConvertedGraph, compiled_record, converted_graphs, is_converted
from amp_compiler.frontend.training_reads import training_lines
from amp_compiler.insight.report_diff import PrecisionDiff, diff_reports
from amp_compiler.insight.report_text import WIDTH, module_table, summarise_paths, wrapped
from amp_compiler.passes.node_facts import facts

PRECISIONS = ("low", "fp32", "cast", "untouched")
TABLE_COLUMNS = ["node", "where", "op", "dtype", "rule"]
FOLLOWING_RULES = ("clear:", "infer:")   # a low node that takes its neighbours' precision decided nothing itself
UNTOUCHED = "untouched (no float value to decide on: integers, shapes, lookups)"
ISLAND_MEANING = "runs of connected nodes kept float32"
LEAVES = "leaf modules kept whole (one call each in the graph, not traced into)"


@dataclass
class PrecisionReport:
    rows: list[dict]             # node, module, op, class, family, precision, dtype, rule (after the filters)
    totals: dict                 # the whole graph: nodes, nodes_per_dtype, untouched, casts, unknown_ops
    summary: dict = field(default_factory=dict)     # gm.meta["amp"]
    islands: list[dict] = field(default_factory=list)
    filters: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)   # values the low dtype cannot hold (constant_range)
    full: bool = False           # str() lists every row, not only the decisions

    def __str__(self) -> str:
        return "\n".join(self.summary_lines() + self.table_lines())

    def summary_lines(self) -> list[str]:
        """The opening lines alone (what the demo prints)."""
        s, t = self.summary, self.totals
        lines = [f"amp-compiler report: level {s.get('level')} (asked {s.get('requested_level')}), "
                 f"{s.get('dtype')}, front end {s.get('frontend')}{_devices(s)}"]
        lines += nothing_converted_lines(s, t)
        lines.append(f"nodes: {self.counts(UNTOUCHED)}")
        for warning in self.warnings:
            lines += wrapped("WARNING", [warning])
        lines += calibration_lines(s.get("pass_counts", {}).get("calibrate_ranges"), t.get("range_kept", []))
        lines += island_lines(self.islands)
        if s.get("leaf_modules"):
            lines += _leaf_lines(s["leaf_modules"])
        lines += [f"opaque: {where or '(whole model)'}: {why}" for where, why in s.get("opaque", {}).items()]
        lines += hook_lines(s.get("hooks", {})) + training_lines(s.get("training_reads", {}))
        opaque = list(s.get("opaque", {}).values())
        for note in s.get("notes", []):
            if not any(why in note for why in opaque):      # the opaque line above already says it
                lines += wrapped("note", [note])
        return lines

    def counts(self, untouched: str = "untouched") -> str:
        t = self.totals
        per_dtype = ", ".join(f"{n} {dtype}" for dtype, n in sorted(t["nodes_per_dtype"].items()))
        unknown = t["unknown_ops"]
        return (f"{per_dtype or 'none painted'}, {t['untouched']} {untouched}; {t['casts']} casts; "
                f"{len(unknown)} unknown ops{': ' + ', '.join(unknown) if unknown else ''}")

    def table_lines(self) -> list[str]:
        """The rows by module: every row with full=True or a filter, else the decisions and a line saying what
        is left out. "where" names the leaf module a row belongs to, under its parent's heading."""
        columns = "node, where (leaf module), op, dtype, rule"
        if self.full or self.filters:
            rows, hidden = self.rows, []
            shown = f"{len(rows)} of {self.totals['rows']} rows ({_describe(self.filters)})" if self.filters \
                else f"all {len(rows)} rows"
            header = [f"{shown}, by module: {columns}"]
        else:
            rows = [row for row in self.rows if is_decision(row)]
            hidden = hidden_counts([row for row in self.rows if not is_decision(row)])
            header = [f"{len(rows)} of {len(self.rows)} rows: the decisions (ops a rule sets low or fp32, casts of "
                      "activations, every fp32 node; explain(model, full=True) lists all), by module: " + columns]
        table = module_table(rows, TABLE_COLUMNS, self.summary.get("leaf_modules", ()))
        return [*header, *table, *hidden, f"totals: {self.counts()}"]

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    def to_json(self, **dumps) -> str:
        data = {"summary": self.summary, "totals": self.totals, "islands": self.islands, "filters": self.filters,
                "warnings": self.warnings, "rows": self.rows}
        return json.dumps(data, default=str, **dumps)    # managers, dtypes: their printed form

    def _repr_html_(self) -> str:
        from amp_compiler.insight.report_html import report_html
        return report_html(self)


def explain(gm, other=None, *, only: str | None = None, module: str | None = None,
            op: str | None = None, full: bool = False) -> PrecisionReport:
    """The decisions of a converted module: summary, fp32 islands, then its nodes grouped by module.

    Printed, the report lists the decisions: ops a rule sets low or fp32, casts of activations, every fp32
    node. full=True lists every node (those that only follow their neighbours, untouched bookkeeping such as
    size and getitem, weight casts); report.rows always holds them all.
    only: "low", "fp32", "cast", "untouched" or a dtype name ("float16"); module, op: glob patterns
    ("encoder.*" also matches "encoder" itself); a filter lists every row it keeps. With a second module,
    diff(gm, other)."""
    if other is not None:
        return diff(gm, other)
    wrapper, gm = gm, converted_model_in(gm)
    if (record := compiled_record(gm)) is not None:   # in place: its graphs made so far, with dynamo's facts
        report = record.explain(gm)
    else:
        report = _explain_graphs(gm, graph_summary(gm), converted_graphs(gm))
    report.full = full
    if wrapper is not gm:
        report.warnings += adapters_not_run(gm)
    filters = {k: v for k, v in (("only", only), ("module", module), ("op", op)) if v is not None}
    if filters:
        _check_only(only)
        report.rows = [row for row in report.rows if _keeps(row, only, module, op)]
        report.filters = filters
    return report


def converted_model_in(module):
    """The converted model a wrapper holds: peft's PeftModel keeps it at base_model.model (LoraModel's `model`),
    whether it was converted in place or convert() returned it before get_peft_model; `module` itself otherwise."""
    for _ in range(4):   # PeftModel -> LoraModel -> the model
        if not isinstance(module, nn.Module) or is_converted(module) or isinstance(module, fx.GraphModule):
            return module
        inner = getattr(module.__dict__.get("_modules", {}).get("base_model"), "model", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner
    return module


def adapters_not_run(gm) -> list[str]:
    """Adapter layers (peft's, which keep the replaced layer as `base_layer`) put into a converted graph after
    convert(): the graph reads the replaced layer's weights itself, so their forward, the adapter, never runs."""
    if not isinstance(gm, fx.GraphModule):
        return []
    read = [node.target for node in gm.graph.nodes if node.op == "get_attr"]
    return [f"{path} became {type(layer).__module__}.{type(layer).__qualname__} after convert(): this graph reads {path}'s weights itself, so the "
            "adapter never runs (outputs are the base model's). Apply the adapters first and convert the adapted "
            "model, or convert(model, inplace=True) before get_peft_model"
            for path, layer in gm.named_modules() if path and isinstance(getattr(layer, "base_layer", None), nn.Module)
            and any(target.startswith(path + ".") for target in read)]


def diff(before, after) -> PrecisionDiff:
    """Node-by-node changes between two conversions of one model (modules from convert())."""
    return diff_reports(explain(before), explain(after))


def is_decision(row: dict) -> bool:
    """A row the printed report lists by default: not untouched, not a weight's copy, not a low node that only
    follows its neighbours."""
    if row["precision"] == "untouched" or row.get("weight"):
        return False
    return not (row["precision"] == "low" and row["rule"].startswith(FOLLOWING_RULES))


def hidden_counts(rows: list[dict]) -> list[str]:
    """What the default table leaves out, counted: "not listed: 56 nodes that follow ..."."""
    kinds = Counter("weight" if row.get("weight") else row["precision"] for row in rows)
    parts = [f"{plural(kinds['low'], 'node')} that take their neighbours' precision (rules clear: and infer:)",
             f"{kinds['untouched']} {UNTOUCHED}", f"{plural(kinds['weight'], 'weight cast')} (a low copy of a parameter "
             "for the op that reads it)"]
    return wrapped("not listed", [part for part in parts if not part.startswith("0 ")]) if rows else []


def _explain_graph(gm: fx.GraphModule, summary: dict) -> PrecisionReport:
    low = summary["dtype"]
    graph_inputs = summary.get("graph_inputs", {})
    rows = []
    for node in gm.graph.nodes:
        if not is_shown(node):
            continue
        amp = facts(node)
        rows.append({"node": node.name, "module": module_of(node), "op": amp.get("op", "?"),
                     "class": amp.get("class", "-"), "family": amp.get("family", "-"), "precision": precision_of(node),
                     "dtype": computed_dtype(node, low), "rule": amp.get("rule", ""),
                     "weight": weight_cast_of(node, graph_inputs)})
    islands = [island.to_dict() for island in fp32_islands(gm)]
    casts = sum(1 for node in gm.graph.nodes if is_cast(node))
    warnings = [facts(node)["warning"] for node in gm.graph.nodes if "warning" in facts(node)]
    return PrecisionReport(rows, node_totals(rows, casts), dict(summary), islands, warnings=warnings)


def _devices(summary: dict) -> str:
    """", device cpu (from the model's parameters)": what the device overlays of the policy were applied for."""
    devices = summary.get("devices")
    return f", device {', '.join(devices['devices'])} (from {devices['from']})" if devices else ""


def node_totals(rows: list[dict], casts: int) -> dict:
    painted = [r for r in rows if r["precision"] in ("low", "fp32")]
    unknown = list(dict.fromkeys(r["op"] for r in rows if r.get("family") == "unknown"))
    return {"nodes": len(painted), "nodes_per_dtype": dict(Counter(r["dtype"] for r in painted)),
            "untouched": sum(1 for r in rows if r["precision"] == "untouched"), "casts": casts,
            "unknown_ops": unknown, "rows": len(rows),
            "range_kept": [r["node"] for r in rows if r["rule"].startswith("range:")]}   # calibration kept fp32


def _explain_graphs(model, summary: dict, graphs: list[ConvertedGraph]) -> PrecisionReport:
    """The report of a convert() result: its graph, or the graphs of its converted children in one table (a
    model run as written), their module paths and warnings prefixed with the child's path."""
    if [gm for _, gm in graphs] == [model]:
        return _explain_graph(model, summary)
    rows, islands, casts, warnings = [], [], 0, []
    for prefix, gm in graphs:
        child = explain(gm)
        rows += [{**row, "module": f"{prefix}.{row['module']}" if row["module"] else prefix} for row in child.rows]
        islands += [{**island, "module": f"{prefix}.{island['module']}".rstrip(".")} for island in child.islands]
        casts += child.totals["casts"]
        warnings += [f"{prefix}: {warning}" for warning in child.warnings]
    return PrecisionReport(rows, node_totals(rows, casts), dict(summary), islands, warnings=warnings)


def nothing_converted_lines(summary: dict, totals: dict) -> list[str]:
    """Said second when no node runs low: what runs instead, and the reason the front end recorded (a model that
    is one opaque call runs under autocast: its numbers are autocast's, not this compiler's)."""
    low = summary.get("dtype")
    ran_low = any(n for dtype, n in totals["nodes_per_dtype"].items() if dtype != "float32")   # fp8 counts too
    if ran_low:
        return []
    opaque = summary.get("opaque", {})
    if summary.get("level") == "O0":
        why = "level O0 runs the model as written, in fp32"
    elif opaque:
        where = [path or "the model itself" for path in opaque]
        why = (f"{'it runs as one opaque call' if len(opaque) == 1 else f'it runs as {len(opaque)} opaque calls'} "
               f"({', '.join(where[:4])}), as written under torch.autocast({low}): its numbers are autocast's; "
               + "; ".join(f"{path or 'the model itself'}: {reason}" for path, reason in list(opaque.items())[:2]))
    else:
        why = f"no op in it is one the {summary.get('level')} policy runs low"
    return wrapped("nothing converted", [f"0 nodes run {low}: {why}"])


def _leaf_lines(leaves: list[str]) -> list[str]:
    """The leaf modules, listed when that takes three lines or less, else with numbered repeats folded."""
    lines = wrapped(LEAVES, leaves)
    if len(lines) > 3:
        lines = wrapped(LEAVES, summarise_paths(leaves))
        lines[-1] += f" ({len(leaves)} modules)"
    return lines


def add_calibration(pass_counts: dict, calibrated: dict | None) -> None:
    """One graph's calibration counts into a report of several (dynamo's graphs): the most samples a graph
    saw, the overflowing nodes of all of them."""
    if calibrated:
        merged = pass_counts.setdefault("calibrate_ranges", {"samples": 0, "nodes_overflowing": 0})
        merged["samples"] = max(merged["samples"], calibrated.get("samples", 0))
        merged["nodes_overflowing"] += calibrated.get("nodes_overflowing", 0)


def calibration_lines(calibrated: dict | None, kept: list[str]) -> list[str]:
    """What range calibration kept fp32 (calibrated: the calibrate_ranges pass's counts; none: no line)."""
    if not calibrated:
        return []
    return wrapped(f"range calibration ({plural(calibrated['samples'], 'sample')}): {plural(len(kept), 'node')} "
                   "kept fp32", kept[:12] + ([f"... {len(kept) - 12} more"] if len(kept) > 12 else []) or ["none"])


def island_lines(islands: list[dict]) -> list[str]:
    """One line per kind of island: those repeating in numbered blocks (layers.3.attention) share one."""
    if not islands:
        return ["fp32 islands: none"]
    kinds: dict[tuple, list[dict]] = {}
    for island in islands:
        kinds.setdefault((_strip_numbers(island["module"]), tuple(island["ops"]), _strip_numbers(island["rule"])),
                         []).append(island)
    lines = [f"fp32 islands: {len(islands)}, {sum(len(i['nodes']) for i in islands)} nodes ({ISLAND_MEANING})"]
    for members in kinds.values():
        first = members[0]
        where = summarise_paths([i["module"] for i in members])
        where = where[0] if len(where) == 1 else f"{where[0]} and {len(where) - 1} more"
        seed_op = first["ops"][first["nodes"].index(first["seed"])]
        ops = ", ".join(first["ops"][:6]) + (", ..." if len(first["ops"]) > 6 else "")
        line = (f"  {where or '(top level)'}{f' (x{len(members)})' if len(members) > 1 else ''}: "
                f"{plural(len(first['nodes']), 'node')} ({ops}); {seed_op}: {first['rule']}")
        lines.append(line if len(line) <= WIDTH + 40 else line[:WIDTH + 37] + "...")
    return lines


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _strip_numbers(text: str) -> str:
    return re.sub(r"\d+", "#", text)


def _check_only(only: str | None) -> None:
    if only is not None and only not in PRECISIONS and not only.startswith(("float", "bfloat")):
        raise ValueError(f"only={only!r}: expected one of {PRECISIONS} or a dtype name such as 'float16'")


def _keeps(row: dict, only, module, op) -> bool:
    if only is not None and only not in (row["precision"], row["dtype"]):
        return False
    if module is not None and not (fnmatch.fnmatchcase(row["module"], module)
                                   or fnmatch.fnmatchcase(row["module"], module.removesuffix(".*"))):
        return False
    return op is None or fnmatch.fnmatchcase(row["op"], op)


def _describe(filters: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in filters.items())
