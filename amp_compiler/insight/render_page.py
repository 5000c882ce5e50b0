"""The picture as one self-contained HTML file: the view's data as JSON, the style and the script inline
(nothing fetched: it opens offline, from disk, with no server)."""
from __future__ import annotations

import json
from html import escape

from amp_compiler.insight.render_script import GRAPH_SCRIPT
from amp_compiler.insight.report_html import PRECISION_COLOURS

STROKES = {"low": "#3b73d9", "fp32": "#d2612c", "cast": "#a07800", "untouched": "#9a9a9a"}

STYLE = """
body { margin: 0; font: 13px system-ui, sans-serif; color: #222; overflow: hidden; }
header { position: fixed; top: 0; left: 0; right: 0; background: #fafafa; border-bottom: 1px solid #ddd;
         padding: 6px 10px; z-index: 2; }
header .title { font-weight: 600; font-size: 15px; }
header details pre { margin: 4px 0; font-size: 11.5px; max-height: 40vh; overflow: auto; }
header button { font-size: 12px; }
.legend span { display: inline-block; margin-left: 10px; }
.legend i { display: inline-block; width: 12px; height: 12px; border: 1.5px solid; vertical-align: -2px;
            margin-right: 3px; border-radius: 2px; }
#canvas { position: fixed; top: 0; left: 0; width: 100vw; height: 100vh; cursor: grab; background: #fff; }
#info { position: fixed; right: 10px; bottom: 10px; max-width: 46vw; white-space: pre-wrap; display: none;
        background: #fffff4; border: 1px solid #bbb; padding: 8px; font: 12px ui-monospace, monospace; z-index: 2; }
.node { cursor: pointer; }
.node text, .group-item text { text-anchor: middle; pointer-events: none; }
.node .op, .group-item .op { font-size: 12px; font-weight: 600; }
.node .sub, .group-item .sub { font-size: 10px; fill: #555; }
.node .shape { stroke-width: 1.5; }
%(node_colours)s
.node.io .shape { fill: #fff; stroke: #333; }
.node.opaque .shape { fill: #e8d9f7; stroke: #7a3fb8; stroke-dasharray: 4 2; }
.node.cast .shape { fill: #ffd43b; stroke-width: 1.5; }
.node.cast .shape.to-low { stroke: %(low)s; } .node.cast .shape.to-fp32 { stroke: %(fp32)s; }
.node.island .shape { stroke: #b3261e; stroke-width: 2.6; stroke-dasharray: 5 2; }
.node.selected .shape { stroke: #000; stroke-width: 3; stroke-dasharray: none; }
.node.island-lit .shape { filter: drop-shadow(0 0 4px #e0442c); }
.edge { fill: none; stroke-width: 1.3; opacity: .75; }
%(edge_colours)s
.edge.back { stroke-dasharray: 4 3; }
.edge.island-edge { stroke: #b3261e; stroke-width: 2.6; opacity: 1; }
.group-item { cursor: pointer; }
.group-item .shape { fill: #fff; stroke: #555; stroke-width: 1.4; }
%(bar_colours)s
.module rect { fill: #6b7a99; fill-opacity: .045; stroke: #8a93a8; stroke-width: 1; }
.module .label { font-size: 11px; fill: #4a5470; cursor: pointer; }
.module .label:hover { fill: #000; text-decoration: underline; }
"""


def _style() -> str:
    return STYLE % {
        "node_colours": "\n".join(f".node.{p} .shape {{ fill: {PRECISION_COLOURS[p]}; stroke: {STROKES[p]}; }}"
                                  for p in ("low", "fp32", "untouched")),
        "edge_colours": "\n".join(f".edge.{p} {{ stroke: {STROKES[p]}; }}" for p in STROKES),
        "bar_colours": "\n".join(f".bar.{p} {{ fill: {STROKES[p]}; }}" for p in STROKES),
        "low": STROKES["low"], "fp32": STROKES["fp32"]}


def _legend(low_dtype: str) -> str:
    entries = [("low", f"low ({low_dtype})"), ("fp32", "fp32"), ("untouched", "untouched"), ("cast", "cast")]
    swatches = "".join(f"<span><i style='background:{PRECISION_COLOURS[p]};border-color:{STROKES[p]}'></i>{label}</span>"
                       for p, label in entries)
    return (f"<span class='legend'>{swatches}<span><i style='border:2px dashed #b3261e'></i>fp32 island</span>"
            "<span><i style='border:1.5px dashed #7a3fb8'></i>opaque</span></span>")


def html_page(view: dict) -> str:
    # "</" inside the JSON would end the script element early
    payload = json.dumps(view, separators=(",", ":")).replace("</", "<\\/")
    low_dtype = next((n["dtype"] for n in view["nodes"] if n["precision"] == "low"), "fp16/bf16")
    title = escape(view["title"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}: amp-compiler precision graph</title>
<script>window.addEventListener("error", e => {{ document.documentElement.dataset.errors =
  (document.documentElement.dataset.errors || "") + e.message + "\\n"; }});</script>
<style>{_style()}</style></head>
<body>
<svg id="canvas"><g id="viewport"><g id="groups"></g><g id="edges"></g><g id="items"></g></g></svg>
<header><span class="title">{title}</span> &middot; {escape(view.get("subtitle", ""))} &middot; {len(view["nodes"])} nodes
<button id="fit">fit</button> <button id="expand-all">expand all</button> collapse modules at depth<span id="depths"></span>
<input id="search" size="18" placeholder="find name, op, module"> <span id="found"></span>
{_legend(low_dtype)}
<details><summary>report summary</summary><pre>{escape(chr(10).join(view["summary"]))}</pre></details>
</header>
<div id="info"></div>
<script type="application/json" id="amp-data">{payload}</script>
<script>{GRAPH_SCRIPT}</script>
</body></html>
"""
