"""PrecisionReport._repr_html_ and OnnxConversionReport._repr_html_: the summary, then the rows as a table
coloured by precision (notebooks)."""
from __future__ import annotations

from html import escape

# the picture (render.py) uses the same colours
PRECISION_COLOURS = {"low": "#cfe0fc", "fp32": "#fbd3c0", "cast": "#fff1b8", "untouched": "#eeeeee"}
FOLD_ABOVE = 40      # rows; longer tables start folded


def report_html(report, rows: list[dict] | None = None) -> str:
    """report: anything with summary_lines(); rows: dicts with module, node, op, dtype, rule and precision
    ("low", "fp32", "cast", "untouched": the colour), report.rows by default."""
    rows = report.rows if rows is None else rows
    summary = "\n".join(report.summary_lines())
    opened = "" if len(rows) > FOLD_ABOVE else " open"
    count, rows = len(rows), "\n".join(_row(r) for r in rows)
    return (f"<div class='amp-report'><pre style='white-space:pre-wrap'>{escape(summary)}</pre>"
            f"<details{opened}><summary>{count} rows</summary>"
            "<table><thead><tr><th>module</th><th>node</th><th>op</th><th>dtype</th><th>rule</th></tr></thead>"
            f"<tbody>\n{rows}\n</tbody></table></details></div>")


def _row(row: dict) -> str:
    colour = PRECISION_COLOURS.get(row["precision"], "#ffffff")
    cells = [row["module"], row["node"], row["op"], row["dtype"], row["rule"]]
    tds = "".join(f"<td style='text-align:left'>{escape(str(c))}</td>" for c in cells)
    return f"<tr style='background:{colour}'>{tds}</tr>"
