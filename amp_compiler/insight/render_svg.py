"""render(..., "graph.svg"): the picture as one static SVG file, laid out in Python (no system binary).

    svg_page(view)   # view: render_view.fx_view / render_onnx_view.onnx_view
    <svg ...><style>...</style><path class="edge low" .../><g class="node op fp32 island"><title>rule</title>...

The same layout as the HTML page's script (render_script.py), run once on the whole graph: layers as late
as possible, four barycenter sweeps to order them; the same colours, cast diamonds and island outlines.
Static: every node shown (no collapsing), each node's rule in its <title> (a tooltip in browsers), the
report's summary as the file's <desc>.
"""
from __future__ import annotations

from html import escape

from amp_compiler.insight.render_page import STROKES
from amp_compiler.insight.report_html import PRECISION_COLOURS

SIZE = {"op": (118, 32), "opaque": (130, 34), "io": (104, 28), "cast": (14, 14)}
GAP_X, GAP_Y, MARGIN = 18, 26, 20

STYLE = "\n".join([
    "text { font: 12px system-ui, sans-serif; text-anchor: middle; }",
    ".op { font-weight: 600; } .sub { font-size: 10px; fill: #555; }",
    ".shape { stroke-width: 1.5; }",
    *(f".node.{p} .shape {{ fill: {PRECISION_COLOURS[p]}; stroke: {STROKES[p]}; }}" for p in ("low", "fp32", "untouched")),
    ".node.io .shape { fill: #fff; stroke: #333; }",
    ".node.opaque .shape { fill: #e8d9f7; stroke: #7a3fb8; stroke-dasharray: 4 2; }",
    f".node.cast .shape {{ fill: #ffd43b; }} .to-low {{ stroke: {STROKES['low']}; }} "
    f".to-fp32 {{ stroke: {STROKES['fp32']}; }}",
    ".node.island .shape { stroke: #b3261e; stroke-width: 2.6; stroke-dasharray: 5 2; }",
    ".edge { fill: none; stroke-width: 1.3; opacity: .75; }",
    *(f".edge.{p} {{ stroke: {colour}; }}" for p, colour in STROKES.items()),
    ".edge.island-edge { stroke: #b3261e; stroke-width: 2.6; opacity: 1; }",
])


def svg_page(view: dict) -> str:
    nodes = view["nodes"]
    x, y, ranks = _layout(nodes)
    width = max((x[i] + SIZE[_kind(n)][0] / 2 for i, n in enumerate(nodes)), default=0) + MARGIN
    height = max((y[i] + SIZE[_kind(n)][1] / 2 for i, n in enumerate(nodes)), default=0) + MARGIN
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}">',
             f"<title>{escape(view['title'])}: amp-compiler precision graph ({escape(view.get('subtitle', ''))}, "
             f"{len(nodes)} nodes)</title>",
             f"<desc>{escape(chr(10).join(view.get('summary', [])))}</desc>",
             f"<style>{STYLE}</style>", '<rect width="100%" height="100%" fill="#fff"/>', '<g class="edges">']
    for target, node in enumerate(nodes):
        for source in node["inputs"]:
            parts.append(_edge(nodes, source, target, x, y, ranks))
    parts.append('</g><g class="nodes">')
    parts += [_node(view, i, node, x[i], y[i]) for i, node in enumerate(nodes)]
    parts.append("</g></svg>\n")
    return "\n".join(parts)


def _kind(node: dict) -> str:
    return node["kind"] if node["kind"] in SIZE else "op"


def _layout(nodes: list[dict]) -> tuple[list[float], list[float], list[int]]:
    """x and y of every node's centre, and its rank (layer)."""
    count = len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    inputs = [[j for j in node["inputs"] if j < i] for i, node in enumerate(nodes)]   # graph order is topological
    for i, sources in enumerate(inputs):
        for j in sources:
            users[j].append(i)
    height = [0] * count
    for k in reversed(range(count)):
        height[k] = max((height[s] + 1 for s in users[k]), default=0)
    top = max(height, default=0)
    rank = [top - h for h in height]
    layers: list[list[int]] = [[] for _ in range(top + 1)] if count else []
    for i in range(count):
        layers[rank[i]].append(i)
    x, want = [0.0] * count, [0.0] * count
    for layer in layers:
        _place(layer, x, want, nodes)
    for sweep in range(4):
        down = sweep % 2 == 0
        for layer in layers if down else reversed(layers):
            for i in layer:
                near = inputs[i] if down else users[i]
                want[i] = sum(x[j] for j in near) / len(near) if near else x[i]
            layer.sort(key=lambda i: want[i])
            _place(layer, x, want, nodes)
    shift = MARGIN - min((x[i] - SIZE[_kind(n)][0] / 2 for i, n in enumerate(nodes)), default=0)
    y, top_y = [0.0] * count, MARGIN
    for layer in layers:
        tallest = max(SIZE[_kind(nodes[i])][1] for i in layer)
        for i in layer:
            x[i] += shift
            y[i] = top_y + tallest / 2
        top_y += tallest + GAP_Y
    return x, y, rank


def _place(layer: list[int], x: list[float], want: list[float], nodes: list[dict]) -> None:
    """Left to right at the wanted x where there is room, then shifted to sit on average where wanted."""
    right, offset = float("-inf"), 0.0
    for i in layer:
        w = SIZE[_kind(nodes[i])][0]
        x[i] = max(want[i], right + GAP_X + w / 2)
        right = x[i] + w / 2
        offset += want[i] - x[i]
    for i in layer:
        x[i] += offset / len(layer) if layer else 0.0


def _edge(nodes: list[dict], source: int, target: int, x, y, ranks) -> str:
    a, b = nodes[source], nodes[target]
    x1, y1 = x[source], y[source] + SIZE[_kind(a)][1] / 2
    x2, y2 = x[target], y[target] - SIZE[_kind(b)][1] / 2
    span = ranks[target] - ranks[source]
    dy = max(20.0, (y2 - y1) / 2)
    bow = min(240, 40 + 6 * span) if span > 1 else 0      # skips layers: bows out past the nodes between
    island = a["island"] >= 0 and a["island"] == b["island"]
    return (f'<path class="edge {a["precision"]}{" island-edge" if island else ""}" d="M{x1:.1f},{y1:.1f} '
            f'C{x1 + bow:.1f},{y1 + dy:.1f} {x2 + bow:.1f},{y2 - dy:.1f} {x2:.1f},{y2:.1f}"/>')


def _node(view: dict, index: int, node: dict, x: float, y: float) -> str:
    kind = _kind(node)
    classes = " ".join(["node", node["kind"], node["precision"], *(["island"] if node["island"] >= 0 else [])])
    module = view["modules"][node["module"]] if view.get("modules") else ""
    tip = escape(f"{node['name']} ({node['op']}{', ' + module if module else ''}) {node['dtype']}: "
                 f"{view['rules'][node['rule']] if view.get('rules') else ''}")
    head = f'<g class="{classes}" data-index="{index}" transform="translate({x:.1f},{y:.1f})"><title>{tip}</title>'
    if kind == "cast":
        to = "fp32" if node["dtype"] == "float32" else "low"
        return f'{head}<path class="shape to-{to}" d="M0,-8 L8,0 L0,8 L-8,0 Z"/></g>'
    w, h = SIZE[kind]
    sub = _clip(node["name"], 20) if node["dtype"] == "-" else node["dtype"]
    return (f'{head}<rect class="shape" x="{-w / 2}" y="{-h / 2}" width="{w}" height="{h}" '
            f'rx="{14 if kind == "io" else 5}"/><text class="op" y="-2">{escape(_clip(node["op"], 17))}</text>'
            f'<text class="sub" y="11">{escape(sub)}</text></g>')


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"
