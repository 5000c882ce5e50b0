"""PrecisionReport._repr_html_: the summary, then the rows as a table coloured by precision (notebooks)."""
from __future__ import annotations

from html import escape

# the picture (render.py) uses the same colours
PRECISION_COLOURS = {"low": "#cfe0fc", "fp32": "#fbd3c0", "cast": "#fff1b8", "untouched": "#eeeeee"}
FOLD_ABOVE = 40      # rows; longer tables start folded


def report_html(report) -> str:
    summary = "\n".join(report.summary_lines())
    rows = "\n".join(_row(r) for r in report.rows)
    opened = "" if len(report.rows) > FOLD_ABOVE else " open"
    return (f"<div class='amp-report'><pre style='white-space:pre-wrap'>{escape(summary)}</pre>"
            f"<details{opened}><summary>{len(report.rows)} rows</summary>"
            "<table><thead><tr><th>module</th><th>node</th><th>op</th><th>dtype</th><th>rule</th></tr></thead>"
            f"<tbody>\n{rows}\n</tbody></table></details></div>")


def _row(row: dict) -> str:
    colour = PRECISION_COLOURS.get(row["precision"], "#ffffff")
    cells = [row["module"], row["node"], row["op"], row["dtype"], row["rule"]]
    tds = "".join(f"<td style='text-align:left'>{escape(str(c))}</td>" for c in cells)
    return f"<tr style='background:{colour}'>{tds}</tr>"
