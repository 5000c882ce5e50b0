"""render(): a picture of what convert() did, as one HTML file that opens offline in any browser.

    amp_compiler.render(gm, "graph.html")
    amp_compiler.render(gm, "graph.svg")                 # a static picture: every node, rules as tooltips
    amp_compiler.render("model_fp16.onnx", "graph.html", report=conversion_report)

Nodes laid out by data flow and coloured by precision (low, fp32, untouched), casts as small diamonds on
the edges they sit on, fp32 islands outlined in red, module paths as boxes that collapse to one node
(large graphs open collapsed to the depth that shows at most 300 items), zoom and pan, each node's rule on
hover and in a panel on click, search by name, op or module. A .svg path writes the same picture as
one static SVG (render_svg.py: laid out in Python, fully expanded, no script).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from amp_compiler.insight.render_page import html_page
from amp_compiler.insight.render_svg import svg_page
from amp_compiler.insight.render_view import fx_view


def render(source, path, *, title: str | None = None, report=None) -> Path:
    """Write the picture of `source` to `path` (.html, or .svg for a static picture); returns the path.

    source: a module returned by convert(), or an ONNX model (a path, onnx_ir.Model or onnx.ModelProto;
    `report`, the OnnxConversionReport of its conversion, supplies the rules a file does not carry)."""
    path = Path(os.fspath(path))
    if path.suffix.lower() not in (".html", ".htm", ".svg"):
        raise ValueError(f"render() writes .html or .svg files, not {path.name!r}")
    if isinstance(source, torch.nn.Module):
        view = fx_view(source, title)
    else:
        from amp_compiler.insight.render_onnx_view import onnx_view
        view = onnx_view(source, report, title)
    page = svg_page(view) if path.suffix.lower() == ".svg" else html_page(view)
    path.write_text(page, encoding="utf-8")
    return path
