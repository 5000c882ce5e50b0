"""The picture's JavaScript, inlined into the page (kept in a .py file so it installs with the package).

It lays the graph out in the browser, so that collapsing a module group re-lays out the smaller graph:
layers as late as possible (a side chain sits next to the node that reads it), a few barycenter sweeps
to order each layer, nodes pulled toward their neighbours' x. Then it draws SVG and handles zoom, pan,
collapse, search and the details panel. No library: the page works offline.
"""

GRAPH_SCRIPT = r"""
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("amp-data").textContent);
  const nodes = data.nodes;
  const SVG = "http://www.w3.org/2000/svg";
  const SIZE = {op: [118, 32], opaque: [130, 34], io: [104, 28], cast: [14, 14], group: [214, 50]};
  const AUTO_LIMIT = 300;          // items shown at first: deeper module levels start collapsed
  const svg = document.getElementById("canvas");
  const viewport = document.getElementById("viewport");
  const layers = {groups: byId("groups"), edges: byId("edges"), items: byId("items")};
  const info = byId("info");
  function byId(id) { return document.getElementById(id); }

  // module groups: every prefix of a node's module path
  const members = new Map();
  const ancestors = nodes.map((node, i) => {
    const parts = data.modules[node.module] ? data.modules[node.module].split(".") : [];
    const paths = parts.map((_, d) => parts.slice(0, d + 1).join("."));
    paths.forEach(p => { if (!members.has(p)) members.set(p, []); members.get(p).push(i); });
    return paths;
  });
  // a box for a module with two computations or more (a Linear and the casts of its weights is one node)
  for (const [path, list] of [...members]) {
    if (list.filter(i => nodes[i].kind !== "cast").length < 2) members.delete(path);
  }
  const depthOf = path => path.split(".").length;
  const maxDepth = Math.max(0, ...[...members.keys()].map(depthOf));
  const users = nodes.map(() => []);
  nodes.forEach((node, i) => node.inputs.forEach(j => users[j].push(i)));
  let collapsed = new Set();

  function itemKey(i) {
    for (const path of ancestors[i]) if (collapsed.has(path)) return "g:" + path;
    return "n:" + i;
  }

  function buildGraph() {
    const items = new Map();
    nodes.forEach((node, i) => {
      const key = itemKey(i);
      if (!items.has(key)) items.set(key, {key, members: [], order: i, preds: new Set(), succs: new Set()});
      items.get(key).members.push(i);
    });
    const edges = [], seen = new Set();
    nodes.forEach((node, i) => node.inputs.forEach(j => {
      const a = items.get(itemKey(j)), b = items.get(itemKey(i)), id = a.key + ">" + b.key;
      if (a === b || seen.has(id)) return;
      seen.add(id);
      // a collapsed group can sit on both sides of an outside node: such edges are drawn, not ranked
      const forward = a.order < b.order;
      edges.push({a, b, forward, source: j, target: i});
      if (forward) { a.succs.add(b); b.preds.add(a); }
    }));
    const list = [...items.values()].sort((x, y) => x.order - y.order);
    list.forEach(item => {
      const first = nodes[item.members[0]];
      item.group = item.key.startsWith("g:") ? item.key.slice(2) : null;
      [item.w, item.h] = SIZE[item.group ? "group" : first.kind] || SIZE.op;
    });
    return {items: list, edges};
  }

  function layout(graph) {
    const items = graph.items, height = new Map();
    for (let k = items.length - 1; k >= 0; k--) {     // successors come later in graph order
      let h = 0;
      for (const s of items[k].succs) h = Math.max(h, height.get(s) + 1);
      height.set(items[k], h);
    }
    const top = Math.max(0, ...height.values()), ranks = [];
    for (const item of items) {
      item.rank = top - height.get(item);
      (ranks[item.rank] = ranks[item.rank] || []).push(item);
    }
    ranks.forEach(place);
    for (let sweep = 0; sweep < 4; sweep++) {
      const down = sweep % 2 === 0;
      for (const rank of down ? ranks : [...ranks].reverse()) {
        for (const item of rank) {
          const near = [...(down ? item.preds : item.succs)];
          item.want = near.length ? near.reduce((s, o) => s + o.x, 0) / near.length : item.x;
        }
        rank.sort((a, b) => a.want - b.want);
        place(rank);
      }
    }
    let y = 0;
    for (const rank of ranks) {
      const h = Math.max(...rank.map(item => item.h));
      rank.forEach(item => { item.y = y + h / 2; });
      y += h + 26;
    }
    graph.ranks = ranks;
  }

  // left to right at the wanted x where there is room, then the row shifted so it sits on average where wanted
  function place(rank) {
    let right = -Infinity, offset = 0;
    for (const item of rank) {
      const want = item.want === undefined ? 0 : item.want;
      item.x = Math.max(want, right + 18 + item.w / 2);
      right = item.x + item.w / 2;
      offset += want - item.x;
    }
    rank.forEach(item => { item.x += offset / rank.length; });
  }

  function el(name, attrs, parent, text) {
    const e = document.createElementNS(SVG, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function nodeText(i) {
    const n = nodes[i], lines = [n.name + "  (" + n.op + ")", "module: " + (data.modules[n.module] || "(top level)"),
      "dtype: " + n.dtype, "rule: " + data.rules[n.rule]];
    if (n.reads.length) lines.push("reads: " + n.reads.join(", "));
    if (n.island >= 0) {
      const island = data.islands[n.island];
      lines.push("fp32 island #" + (n.island + 1) + ": " + island.size + " nodes, seeded by " + island.seed);
    }
    return lines.join("\n");
  }

  function counts(list) {
    const c = {low: 0, fp32: 0, cast: 0, untouched: 0};
    list.forEach(i => { c[nodes[i].precision] = (c[nodes[i].precision] || 0) + 1; });
    return c;
  }

  function draw() {
    const graph = buildGraph();
    layout(graph);
    Object.values(layers).forEach(layer => { layer.textContent = ""; });
    drawGroups(graph);
    for (const e of graph.edges) drawEdge(e);
    for (const item of graph.items) item.group ? drawGroupItem(item) : drawNode(item);
    document.body.dataset.items = graph.items.length;
    document.body.dataset.nodes = graph.items.filter(item => !item.group).length;
    current = graph;
  }
  let current = null;

  function drawNode(item) {
    const i = item.members[0], n = nodes[i];
    const classes = ["node", n.kind, n.precision].concat(n.island >= 0 ? ["island"] : []);
    const g = el("g", {"class": classes.join(" "), "data-index": i, "data-name": n.name,
                       transform: "translate(" + item.x + "," + item.y + ")"}, layers.items);
    el("title", {}, g, nodeText(i));
    if (n.kind === "cast") {
      el("path", {d: "M0,-8 L8,0 L0,8 L-8,0 Z", "class": "shape to-" + (n.dtype === "float32" ? "fp32" : "low")}, g);
      return;
    }
    el("rect", {x: -item.w / 2, y: -item.h / 2, width: item.w, height: item.h, rx: n.kind === "io" ? 14 : 5,
                "class": "shape"}, g);
    el("text", {y: -2, "class": "op"}, g, clip(n.op, 17));
    el("text", {y: 11, "class": "sub"}, g, n.dtype === "-" ? clip(n.name, 20) : n.dtype);
    g.addEventListener("click", ev => { ev.stopPropagation(); select(i); });
  }

  function drawGroupItem(item) {
    const c = counts(item.members);
    const g = el("g", {"class": "group-item", "data-group": item.group, "data-members": item.members.length,
                       transform: "translate(" + item.x + "," + item.y + ")"}, layers.items);
    el("title", {}, g, item.group + ": " + item.members.length + " nodes (click to expand)");
    el("rect", {x: -item.w / 2, y: -item.h / 2, width: item.w, height: item.h, rx: 7, "class": "shape"}, g);
    el("text", {y: -9, "class": "op"}, g, "\u25b8 " + clip(item.group, 28));
    el("text", {y: 5, "class": "sub"}, g, item.members.length + " nodes: " + c.low + " low, " + c.fp32 + " fp32, " +
       c.cast + " casts");
    let x = -item.w / 2 + 8;
    const total = item.members.length, width = item.w - 16;
    for (const p of ["low", "fp32", "untouched", "cast"]) {
      const w = width * c[p] / total;
      if (w > 0) el("rect", {x, y: 13, width: w, height: 7, "class": "bar " + p}, g);
      x += w;
    }
    g.addEventListener("click", ev => { ev.stopPropagation(); collapsed.delete(item.group); draw(); });
  }

  function drawEdge(e) {
    const a = e.a, b = e.b, x1 = a.x, y1 = a.y + a.h / 2, x2 = b.x, y2 = b.y - b.h / 2;
    const span = b.rank - a.rank, dy = Math.max(20, (y2 - y1) / 2);
    // an edge that skips layers bows out to the side, so it does not run through the nodes between
    const bow = e.forward && span > 1 ? Math.min(240, 40 + 6 * span) : 0;
    const d = e.forward
      ? "M" + x1 + "," + y1 + " C" + (x1 + bow) + "," + (y1 + dy) + " " + (x2 + bow) + "," + (y2 - dy) + " " + x2 + "," + y2
      : "M" + x1 + "," + y1 + " C" + (x1 + 160) + "," + (y1 + 80) + " " + (x2 + 160) + "," + (y2 - 80) + " " + x2 + "," + y2;
    const source = nodes[e.source], target = nodes[e.target];
    const inIsland = source.island >= 0 && source.island === target.island && !a.group && !b.group;
    el("path", {d, "class": "edge " + source.precision + (e.forward ? "" : " back") + (inIsland ? " island-edge" : "")},
       layers.edges);
  }

  function drawGroups(graph) {
    const byKey = new Map(graph.items.map(item => [item.key, item]));
    const boxes = [];
    for (const [path, list] of members) {
      if (collapsed.has(path) || ancestors[list[0]].some(p => collapsed.has(p) && p.length < path.length)) continue;
      const shown = [...new Set(list.map(i => byKey.get(itemKey(i))))];
      if (shown.length >= 2) boxes.push({path, list, shown, nested: 0});
    }
    // a box is padded by the boxes nested in it, so that every label has its own line
    boxes.sort((a, b) => depthOf(b.path) - depthOf(a.path));
    for (const box of boxes) {
      for (const inner of boxes) if (inner.path.startsWith(box.path + ".")) box.nested = Math.max(box.nested, inner.nested + 1);
    }
    for (const {path, list, shown, nested} of boxes) {
      const side = 8 + 8 * nested, above = 16 + 16 * nested;
      const x0 = Math.min(...shown.map(it => it.x - it.w / 2)) - side, x1 = Math.max(...shown.map(it => it.x + it.w / 2)) + side;
      const y0 = Math.min(...shown.map(it => it.y - it.h / 2)) - above, y1 = Math.max(...shown.map(it => it.y + it.h / 2)) + side;
      const g = el("g", {"class": "module", "data-group": path}, layers.groups);
      el("rect", {x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 8}, g);
      const label = el("text", {x: x0 + 6, y: y0 + 12, "class": "label"}, g, "\u25be " + path);
      el("title", {}, label, path + ": " + list.length + " nodes (click to collapse)");
      label.addEventListener("click", ev => { ev.stopPropagation(); collapsed.add(path); draw(); });
    }
  }

  function clip(text, n) { return text.length > n ? text.slice(0, n - 1) + "\u2026" : text; }

  function select(i) {
    document.querySelectorAll(".selected, .island-lit").forEach(e => e.classList.remove("selected", "island-lit"));
    const n = nodes[i];
    document.querySelectorAll('[data-index="' + i + '"]').forEach(e => e.classList.add("selected"));
    if (n.island >= 0) nodes.forEach((m, j) => {
      if (m.island === n.island) document.querySelectorAll('[data-index="' + j + '"]').forEach(e => e.classList.add("island-lit"));
    });
    info.textContent = nodeText(i) + "\ninputs: " + (n.inputs.map(j => nodes[j].name).join(", ") || "-") +
      "\nusers: " + (users[i].map(j => nodes[j].name).join(", ") || "-");
    info.style.display = "block";
  }

  // zoom about the cursor, drag to pan
  const view = {x: 0, y: 0, k: 1};
  function apply() { viewport.setAttribute("transform", "translate(" + view.x + "," + view.y + ") scale(" + view.k + ")"); }
  svg.addEventListener("wheel", ev => {
    ev.preventDefault();
    const f = Math.exp(-ev.deltaY * 0.0015), r = svg.getBoundingClientRect();
    const px = ev.clientX - r.left, py = ev.clientY - r.top;
    view.x = px - (px - view.x) * f; view.y = py - (py - view.y) * f; view.k *= f;
    apply();
  }, {passive: false});
  let drag = null;
  svg.addEventListener("mousedown", ev => { drag = {x: ev.clientX - view.x, y: ev.clientY - view.y}; });
  window.addEventListener("mousemove", ev => { if (drag) { view.x = ev.clientX - drag.x; view.y = ev.clientY - drag.y; apply(); } });
  window.addEventListener("mouseup", () => { drag = null; });
  svg.addEventListener("click", () => { info.style.display = "none"; });

  function fit() {
    const items = current.items, r = svg.getBoundingClientRect();
    const x0 = Math.min(...items.map(it => it.x - it.w / 2)) - 60, x1 = Math.max(...items.map(it => it.x + it.w / 2)) + 260;
    const y0 = Math.min(...items.map(it => it.y - it.h / 2)) - 40;
    // fit the width; a tall graph starts at its top, readable, and scrolls with drag or wheel
    view.k = Math.min(1, r.width / (x1 - x0));
    view.x = (r.width - (x1 + x0) * view.k) / 2;
    view.y = -y0 * view.k + document.querySelector("header").offsetHeight + 10;
    apply();
  }

  function centreOn(i) {
    const item = current.items.find(it => it.members.includes(i)), r = svg.getBoundingClientRect();
    view.k = Math.max(view.k, 0.8);
    view.x = r.width / 2 - item.x * view.k; view.y = r.height / 3 - item.y * view.k;
    apply();
  }

  function collapseTo(depth) {
    collapsed = new Set([...members.keys()].filter(p => depthOf(p) === depth));
  }

  function autoCollapse() {
    collapsed = new Set();
    if (nodes.length <= AUTO_LIMIT) return;
    for (let d = maxDepth; d >= 1; d--) {
      collapseTo(d);
      if (new Set(nodes.map((_, i) => itemKey(i))).size <= AUTO_LIMIT) return;
    }
  }

  const depths = byId("depths");
  for (let d = 1; d <= maxDepth; d++) {
    const b = document.createElement("button");
    b.textContent = String(d);
    b.onclick = () => { collapseTo(d); draw(); fit(); };
    depths.appendChild(document.createTextNode(" "));
    depths.appendChild(b);
  }
  byId("expand-all").onclick = () => { collapsed = new Set(); draw(); fit(); };
  byId("fit").onclick = fit;
  let found = [], foundAt = 0, lastQuery = "";
  function find(query) {
    const q = query.trim().toLowerCase();
    if (!q) return;
    if (q !== lastQuery) {
      found = nodes.map((n, i) => i).filter(i => (nodes[i].name + " " + nodes[i].op + " " + data.modules[nodes[i].module])
        .toLowerCase().includes(q));
      foundAt = 0; lastQuery = q;
    }
    byId("found").textContent = found.length ? (foundAt % found.length + 1) + "/" + found.length : "no match";
    if (!found.length) return;
    const i = found[foundAt++ % found.length];
    ancestors[i].forEach(p => collapsed.delete(p));
    draw(); centreOn(i); select(i);
  }
  byId("search").addEventListener("keydown", ev => { if (ev.key === "Enter") find(ev.target.value); });

  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash === "expand-all") collapsed = new Set();
  else if (hash.startsWith("depth=")) collapseTo(Number(hash.slice(6)));
  else autoCollapse();
  draw();
  fit();
  if (hash.startsWith("find=")) find(hash.slice(5));     // a link to one node: graph.html#find=softmax_3
  document.body.dataset.ready = "1";
})();
"""
