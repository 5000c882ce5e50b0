"""render(): one offline HTML file that a real browser lays out, node for node."""
import json
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import convert, render
from models import build
from models.gpt import GPTConfig, GPTLanguageModel
from test_frontend_capture import ListLoop

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER = os.environ.get("AMP_BROWSER") or next(filter(None, map(shutil.which, BROWSERS)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (Debian: apt-get install chromium; "
                                   "or set AMP_BROWSER): the page is checked in a real headless browser")


@pytest.fixture(scope="module")
def gpt_o1():
    task = build("gpt", size="small", seed=0)
    return convert(task.model, "O1", example_inputs=task.example_inputs)


@pytest.fixture(scope="module")
def deep_gpt():
    """40 transformer blocks: about 2,000 nodes, the size the picture must stay usable at."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_length=16, dim=16, num_heads=2, num_layers=40, feed_forward_dim=32,
                       batch_size=2)
    return convert(GPTLanguageModel(config), "O1", example_inputs=(torch.randint(64, (2, 16)),))


def picture_nodes(gm):
    return [n for n in gm.graph.nodes if n.op != "get_attr"]


def embedded_view(path) -> dict:
    text = open(path, encoding="utf-8").read()
    payload = re.search(r'<script type="application/json" id="amp-data">(.*?)</script>', text, re.S).group(1)
    return json.loads(payload.replace("<\\/", "</"))


class ExternalReferences(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        self.found += [f"<{tag} {k}={v}>" for k, v in attrs if k in ("src", "href") and v]


def test_the_page_is_one_file_that_needs_nothing_else(gpt_o1, tmp_path):
    path = render(gpt_o1, tmp_path / "graph.html")
    assert path == tmp_path / "graph.html" and os.listdir(tmp_path) == ["graph.html"]
    text = path.read_text()
    parser = ExternalReferences()
    parser.feed(text)
    assert parser.found == []                      # no CDN script, stylesheet, font or image
    assert "@import" not in text and "url(" not in text


def test_the_view_holds_every_node_with_its_precision_and_rule(gpt_o1, tmp_path):
    view = embedded_view(render(gpt_o1, tmp_path / "graph.html"))
    nodes = picture_nodes(gpt_o1)
    assert [n["name"] for n in view["nodes"]] == [n.name for n in nodes]
    casts = [n for n in view["nodes"] if n["kind"] == "cast"]
    assert len(casts) == gpt_o1.meta["amp"]["casts"] and {c["precision"] for c in casts} == {"cast"}
    softmax = next(n for n in view["nodes"] if n["op"] == "softmax")
    assert softmax["precision"] == "fp32" and view["rules"][softmax["rule"]].startswith("deny:")
    assert view["islands"][softmax["island"]]["seed"] == "softmax"
    assert view["modules"][softmax["module"]] == "layers.0.attention"
    linear = next(n for n in view["nodes"] if n["op"] == "linear")
    assert linear["dtype"] == "float16" and linear["reads"] == []      # its weight arrives through a cast
    weight_cast = view["nodes"][linear["inputs"][1]]
    assert weight_cast["kind"] == "cast" and weight_cast["reads"] == ["layers.0.attention.query.weight"]
    position = {n.name: i for i, n in enumerate(nodes)}
    assert all(i < position[n["name"]] for n in view["nodes"] for i in n["inputs"])   # edges point forward


@pytest.mark.slow
def test_a_model_run_as_written_shows_its_converted_children(tmp_path):
    model = ListLoop()      # a forward over a list of images: only its children convert
    converted = convert(model, "O1", dtype=torch.bfloat16, example_inputs=([torch.randn(3, 8, 8)],))
    assert "children" in converted.meta["amp"]
    view = embedded_view(render(converted, tmp_path / "graph.html"))
    assert view["nodes"] and all(view["modules"][n["module"]].startswith("backbone") for n in view["nodes"]
                                 if n["kind"] != "io")


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), -1))


@pytest.fixture(scope="module")
def onnx_fp16(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "head_fp16.onnx"
    report = amp_compiler.export_onnx(Head(), (torch.randn(2, 8),), path, level="O1")
    return path, report


@pytest.mark.slow
def test_an_onnx_file_is_drawn_from_its_types_with_the_reports_rules(onnx_fp16, tmp_path):
    import onnx_ir as ir
    path, report = onnx_fp16
    model = ir.load(path)
    view = embedded_view(render(path, tmp_path / "onnx.html", report=report))
    assert len(view["nodes"]) == len(model.graph.inputs) + len(list(model.graph)) + len(model.graph.outputs)
    assert sum(n["kind"] == "cast" for n in view["nodes"]) == report.casts > 0
    softmax = next(n for n in view["nodes"] if n["op"] == "Softmax")
    assert softmax["precision"] == "fp32" and view["rules"][softmax["rule"]].startswith("deny:")
    assert view["islands"][softmax["island"]]["seed"] == softmax["name"]
    assert {n["precision"] for n in view["nodes"] if n["op"] in ("MatMul", "Gemm")} == {"low"}
    assert view["modules"][next(n for n in view["nodes"] if n["op"] in ("MatMul", "Gemm"))["module"]] == "a"
    bare = embedded_view(render(str(path), tmp_path / "bare.html"))        # the file alone: types, no rules
    assert "pass report=" in bare["rules"][next(n for n in bare["nodes"] if n["op"] == "Softmax")["rule"]]


def test_only_html_and_svg_are_written(gpt_o1, tmp_path):
    with pytest.raises(ValueError, match="writes .html or .svg"):
        render(gpt_o1, tmp_path / "graph.png")
    with pytest.raises(ValueError, match="returned by amp_compiler.convert"):
        render(torch.fx.symbolic_trace(nn.Linear(2, 2)), tmp_path / "graph.html")


def svg_nodes(path) -> list:
    import xml.etree.ElementTree as ET
    root = ET.parse(path).getroot()                 # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg" and root.find(f"{ns}style") is not None
    return [(g.get("class").split(), g.find(f"{ns}title").text) for g in root.iter(f"{ns}g") if g.get("data-index")], \
        root.findall(f".//{ns}path[@class]")


def test_svg_is_the_same_picture_laid_out_in_python(gpt_o1, tmp_path):
    path = render(gpt_o1, tmp_path / "graph.svg")
    view = embedded_view(render(gpt_o1, tmp_path / "graph.html"))
    drawn, paths = svg_nodes(path)
    assert len(drawn) == len(view["nodes"]) == len(picture_nodes(gpt_o1))
    assert [classes[1:3] for classes, _ in drawn] == [[n["kind"], n["precision"]] for n in view["nodes"]]
    assert sum("island" in classes for classes, _ in drawn) == sum(n["island"] >= 0 for n in view["nodes"]) > 0
    softmax = next(title for classes, title in drawn if title.startswith("softmax "))
    assert "float32: deny: " in softmax and "layers.0.attention" in softmax          # the rule as the tooltip
    edges = [p for p in paths if p.get("class").startswith("edge")]
    assert len(edges) == sum(len(n["inputs"]) for n in view["nodes"])
    text = path.read_text()
    assert "<script" not in text and "href" not in text and "url(" not in text      # static, needs nothing
    ys = [float(re.search(r"translate\([-\d.]+,([-\d.]+)\)", line).group(1))
          for line in text.splitlines() if 'data-index="' in line]
    names = [n["name"] for n in view["nodes"]]
    for i, node in enumerate(view["nodes"]):                 # data flows down: every input sits above its reader
        assert all(ys[j] < ys[i] for j in node["inputs"]), names[i]


@pytest.mark.slow
def test_an_onnx_file_is_drawn_as_svg_too(onnx_fp16, tmp_path):
    path, report = onnx_fp16
    drawn, _ = svg_nodes(render(path, tmp_path / "onnx.svg", report=report))
    assert sum("cast" in classes for classes, _ in drawn) == report.casts
    assert any(title.startswith("node_softmax") or " (Softmax" in title for _, title in drawn)


def test_public_name():
    assert amp_compiler.render is render and "render" in amp_compiler.__all__


def headless(page, *flags, fragment: str = "") -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   f"--user-data-dir={profile}", *flags, f"file://{page}{fragment}"]
        return subprocess.run(command, capture_output=True, text=True, timeout=90)


def body_data(dom: str) -> dict:
    body = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-([a-z]+)="([^"]*)"', body))


@needs_browser
def test_chromium_draws_every_node_and_writes_a_screenshot(gpt_o1, tmp_path):
    page = render(gpt_o1, tmp_path / "graph.html")
    dom = headless(page, "--dump-dom", fragment="#expand-all").stdout
    assert 'data-errors' not in re.search(r"<html[^>]*>", dom).group(0), dom[:400]
    assert body_data(dom)["ready"] == "1"
    drawn = re.findall(r'<g class="node [^"]*" data-index="\d+" data-name="([^"]+)"', dom)
    assert sorted(drawn) == sorted(n.name for n in picture_nodes(gpt_o1))
    assert len(re.findall(r'<path [^>]*class="edge ', dom)) >= len(picture_nodes(gpt_o1)) - 2
    assert dom.count('class="module"') >= 3                       # layers, layers.0, layers.0.attention, ...
    linked = headless(page, "--dump-dom", fragment="#find=softmax_1").stdout     # a link to one node
    panel = re.search(r'<div id="info"[^>]*>(.*?)</div>', linked, re.S).group(1)
    assert panel.startswith("softmax_1  (softmax)") and "fp32 island" in panel
    shot = tmp_path / "graph.png"
    headless(page, f"--screenshot={shot}", "--window-size=1400,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


@needs_browser
def test_chromium_draws_an_onnx_page(onnx_fp16, tmp_path):
    path, report = onnx_fp16
    page = render(path, tmp_path / "onnx.html", report=report)
    view = embedded_view(page)
    dom = headless(page, "--dump-dom", fragment="#expand-all").stdout
    assert 'data-errors' not in re.search(r"<html[^>]*>", dom).group(0)
    assert int(body_data(dom)["nodes"]) == len(view["nodes"]) == len(re.findall(r'<g class="node ', dom))


@needs_browser
def test_a_2000_node_graph_opens_collapsed_by_module_and_expands(deep_gpt, tmp_path):
    nodes = picture_nodes(deep_gpt)
    assert len(nodes) > 1800            # 2,053 at O1 today (2,013 when written; the count moves with cast placement)
    page = render(deep_gpt, tmp_path / "deep.html")
    dom = headless(page, "--dump-dom").stdout
    data = body_data(dom)
    assert data["ready"] == "1" and int(data["items"]) <= 300
    members = sum(int(m) for m in re.findall(r'class="group-item" data-group="[^"]+" data-members="(\d+)"', dom))
    assert members > 0.85 * len(nodes) and members + int(data["nodes"]) == len(nodes)      # every node drawn or inside a box
    assert 'data-group="layers.39"' in dom
    expanded = body_data(headless(page, "--dump-dom", fragment="#expand-all").stdout)
    assert int(expanded["nodes"]) == len(nodes)
