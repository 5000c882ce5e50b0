"""Cast placement that counts bytes: after painting, move the casts at the edges of fp32 islands to the side
of a data-movement op where fewer bytes cross (a `painted` hook of the decide step, decide.py; any IR).

    x (fp32, 4 MB) -> slice (low) -> linear     ->   x -> slice (fp32) -> [cast 0.3 MB] -> linear
    m (fp32, 8 KB) -> expand (fp32) -> add (low) ->  m -> [cast 8 KB] -> expand (low) -> add
    view node "slice_1": precision low -> fp32, rule "placement: 4.2 MB cast -> 0.3 MB"

The IR adapter hands over a ValueFlow: the bytes of every float value (its fp32 size), who reads it and in
which precision the nodes outside the view (inputs, weights, the graph's output) hold or want it. A value
costs its bytes when its readers want another precision than its producer's (one cast per value and dtype,
as insert_casts makes them). Placement is a minimum s-t cut (networkx) of that cost over the nodes free to
move, low on the source side, fp32 on the sink side, each hyperedge "producer + readers" cut at most once
(Lawler's construction); a unit of preference keeps every node that gains nothing where painting put it.
Free to move, and only so (never into a state a rule forbids):
- an infer or clear node painting made low may become fp32 (more precise; a cast moves after it);
- a clear node painting made fp32 may become low when its float inputs are low anyway (no new rounding),
  or else only if every reader that wants a precision ends low (they round it anyway: a deny op never
  reads a value rounded by the move);
- forced nodes, allow and deny ops, nodes with several outputs or an unknown size never move.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov

LOW, FP32 = "low", "fp32"
SOURCE, SINK = ("end", LOW), ("end", FP32)


@dataclass
class ValueFlow:
    """What the IR adapter knows about values, by node name."""
    value_bytes: dict[str, int]                                  # producer -> bytes of its float value (fp32 size)
    readers: dict[str, list[str]]                                # producer -> readers that want a precision
    fixed: dict[str, str] = field(default_factory=dict)          # nodes outside the view: "low" | "fp32"
    movable: set[str] = field(default_factory=set)               # view nodes with one value of known size


def cast_bytes(flow: ValueFlow, precision: dict[str, str]) -> int:
    """Bytes cast per call: each value whose readers want a precision its producer does not have."""
    total = 0
    for producer, readers in flow.readers.items():
        have = precision.get(producer, flow.fixed.get(producer))
        if have is not None and any(precision.get(r, flow.fixed.get(r)) not in (None, have) for r in readers):
            total += flow.value_bytes.get(producer, 0)
    return total


class CastPlacement:
    """The painted hook; `counts` holds bytes_cast_before / bytes_cast_after / nodes_moved once it ran."""

    def __init__(self, flow: ValueFlow, method: str = "cut"):
        self.flow, self.counts, self.method = flow, {}, method
        self.inputs: dict[str, list[str]] = {}   # reader -> the producers it reads
        for producer, readers in flow.readers.items():
            for reader in readers:
                self.inputs.setdefault(reader, []).append(producer)

    def __call__(self, view: nx.DiGraph) -> None:
        flow = self.flow
        painted = {n: a["precision"] for n, a in view.nodes(data=True)}
        before = cast_bytes(flow, painted)

        def stays_low(producer):   # low whatever the placement does
            if producer not in view:
                return flow.fixed.get(producer) == LOW
            fixed = producer not in flow.movable or _freedom(view.nodes[producer], [], None, flow) is None
            return painted[producer] == LOW and fixed

        free = {n: _freedom(view.nodes[n], self.inputs.get(n, []), stays_low, flow) for n in view if n in flow.movable}
        free = _around_casts({n: way for n, way in free.items() if way is not None}, flow, painted)
        search = _min_cut if self.method == "cut" else self._greedy
        placed = search(flow, painted, free) if free else painted
        after = cast_bytes(flow, placed)
        moved = [n for n in free if placed[n] != painted[n]]
        if after >= before:   # a cut never loses, but a ValueFlow that disagrees with the view may: keep painting
            moved, after = [], before
        for name in moved:
            local_before = self._local_bytes(name, painted)
            local_after = self._local_bytes(name, placed)
            attrs = view.nodes[name]
            attrs["precision"] = placed[name]
            attrs["rule"] = f"placement: {_size(local_before)} cast -> {_size(local_after)} ({attrs['rule']})"
        self.counts = {"bytes_cast_before": before, "bytes_cast_after": after, "nodes_moved": len(moved)}

    def _greedy(self, flow: ValueFlow, painted: dict, free: dict) -> dict:
        """The local alternative the cut is compared with (benchmarks/bench_placement.py): flip one node at a
        time while that lowers the bytes of the values it reads and writes. A chain (view -> slice) whose
        first flip alone gains nothing stays as painted."""
        placed, improved = dict(painted), True
        while improved:
            improved = False
            for name, way in free.items():
                flipped = FP32 if placed[name] == LOW else LOW
                if flipped == LOW and way == "low_if_readers_low" and any(
                        placed.get(r, flow.fixed.get(r)) == FP32 for r in flow.readers.get(name, [])):
                    continue
                if flipped == FP32 and any(free.get(p) == "low_if_readers_low" and placed[p] == LOW
                                           for p in self.inputs.get(name, [])):
                    continue   # a clear op made low on the promise that its readers stay low
                before = self._local_bytes(name, placed)
                placed[name] = flipped
                if self._local_bytes(name, placed) < before:
                    improved = True
                else:
                    placed[name] = LOW if flipped == FP32 else FP32
        return placed

    def _local_bytes(self, name: str, precision: dict) -> int:
        """Bytes cast on the values a node reads and writes."""
        touching = {name, *self.inputs.get(name, [])}
        readers = {p: self.flow.readers[p] for p in touching if p in self.flow.readers}
        return cast_bytes(ValueFlow(self.flow.value_bytes, readers, self.flow.fixed), precision)


def _freedom(attrs: dict, producers: list[str], stays_low, flow: ValueFlow) -> str | None:
    """None (stays), "any", or "low_if_readers_low" for a clear node that may go low only with its readers."""
    if attrs.get("forced") or attrs["op_class"] not in ("infer", "clear"):
        return None
    if attrs["precision"] == LOW:
        return "any"
    if attrs["op_class"] != "clear":
        return None   # an fp32 infer op computes: painting kept it fp32 for a reason
    if producers and all(stays_low(p) for p in producers):
        return "any"   # its inputs are low whatever happens: moving it rounds nothing
    return "low_if_readers_low"


def _around_casts(free: dict, flow: ValueFlow, painted: dict) -> dict:
    """The free nodes of groups (free nodes sharing a value) that touch a value cast today: moving a group
    that touches none cannot lower the bytes, and the cut stays small (a deep MLP's ReLUs stay out)."""
    sharing = nx.Graph()
    sharing.add_nodes_from(free)
    touching_casts = set()
    for producer, readers in flow.readers.items():
        members = [m for m in (producer, *readers) if m in free]
        sharing.add_edges_from(zip(members, members[1:]))
        have = painted.get(producer, flow.fixed.get(producer))
        if members and any(painted.get(r, flow.fixed.get(r)) not in (None, have) for r in readers):
            touching_casts.add(members[0])
    worth = set().union(*(group for group in nx.connected_components(sharing) if group & touching_casts))
    return {n: way for n, way in free.items() if n in worth}


def _min_cut(flow: ValueFlow, painted: dict, free: dict) -> dict:
    """The precisions that cast the fewest bytes, free nodes moving, the rest as painted or fixed."""
    nodes_of_interest = set(free)
    network = nx.DiGraph()
    scale = len(free) + 1   # bytes dominate; the unit preference only breaks ties toward painting

    def side(name):
        return painted.get(name, flow.fixed.get(name))

    def vertex(name):
        key = ("n", name)
        if key not in network and name not in free:
            network.add_edge(SOURCE, key) if side(name) == LOW else network.add_edge(key, SINK)   # no capacity: infinite
        return key

    for producer, readers in flow.readers.items():
        members = [producer, *readers]
        if not nodes_of_interest.intersection(members) or side(producer) is None:
            continue
        members = [m for m in members if side(m) is not None]
        weight = flow.value_bytes.get(producer, 0) * scale
        hyper_in, hyper_out = ("in", producer), ("out", producer)
        network.add_edge(hyper_in, hyper_out, capacity=weight)
        for member in members:
            network.add_edge(vertex(member), hyper_in)
            network.add_edge(hyper_out, vertex(member))
    for name, way in free.items():
        key = vertex(name)
        if painted[name] == LOW:
            network.add_edge(SOURCE, key, capacity=1)
        else:
            network.add_edge(key, SINK, capacity=1)
        if way == "low_if_readers_low":
            for reader in flow.readers.get(name, []):
                if side(reader) is not None:
                    network.add_edge(key, vertex(reader))   # low here forces low there
    if SOURCE not in network or SINK not in network:
        return painted
    # The source side is the nodes that cannot reach SINK in the residual network of a maximum flow: the same set
    # for every maximum flow, so the fastest algorithm (Boykov-Kolmogorov: 4x preflow-push on a 32-layer LLM) is
    # free to find it.
    _, (low_side, _) = nx.minimum_cut(network, SOURCE, SINK, flow_func=boykov_kolmogorov)
    placed = dict(painted)
    for name in free:
        placed[name] = LOW if ("n", name) in low_side else FP32
    return placed


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
