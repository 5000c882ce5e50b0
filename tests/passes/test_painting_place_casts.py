"""Cast placement (passes/painting/place_casts.py): casts move to the side of a data-movement op where fewer
bytes cross; outputs and gradients stay those of the painted graph, forced nodes never move."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_compiler import convert, explain
from amp_compiler.passes.painting.place_casts import CastPlacement, ValueFlow, cast_bytes

LOW = torch.bfloat16


class SliceExpandPool(nn.Module):
    """Edges of fp32 islands where painting casts the big side:
    a slice and a max of a big fp32 input read by linears (one cast of the input, before both),
    a small low gate expanded into an fp32 residual add (no cast at all: the add upcasts as it reads, so
    placement leaves the expand low; before promote_in_kernel it moved the expand to fp32),
    a max pool of a big fp32 image read by a conv (cast before the pool)."""

    def __init__(self):
        super().__init__()
        self.proj, self.gate, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.norm = nn.LayerNorm(32)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, img):
        head = self.proj(x[:, :16])                                           # (4, 16, 32) of (4, 256, 32)
        gate = self.gate(x.amax(dim=1, keepdim=True)).expand(-1, 256, -1)    # (4, 1, 32) made (4, 256, 32)
        residual = self.norm(x.softmax(-1) + gate)                            # fp32: softmax's value + the gate
        pooled = self.conv(F.max_pool2d(img, 4))                              # (2, 3, 64, 64) -> (2, 3, 16, 16)
        return self.out(head).sum() + residual.sum() + pooled.sum()


def inputs():
    torch.manual_seed(0)
    return torch.randn(4, 256, 32), torch.randn(2, 3, 64, 64)


class CastBytes(TorchDispatchMode):
    """Bytes of the dtype-changing aten._to_copy calls (their fp32 side)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].dtype != out.dtype:
            self.bytes += max(args[0].nbytes, out.nbytes)
        return out


def runtime_cast_bytes(gm, args) -> int:
    with torch.no_grad(), CastBytes() as counter:
        gm(*args)
    return counter.bytes


def gradients(gm, model, args):
    model.zero_grad()
    leaves = [a.clone().requires_grad_() for a in args]
    out = gm(*leaves)
    out.backward()
    # A max's gradient goes to one of the values bf16 rounding ties (the painted graph maxes rounded values,
    # the placed one exact values): compare the inputs' gradients per pooling window and over amax's dim.
    x_grad, img_grad = (leaf.grad for leaf in leaves)
    return out.detach(), [p.grad.clone() for p in model.parameters()] + [x_grad.sum(1), F.avg_pool2d(img_grad, 4)]


def rules(gm) -> dict:
    return {row["node"]: (row["dtype"], row["rule"]) for row in explain(gm).rows}


@pytest.mark.slow
def test_casts_move_to_the_small_side_with_the_same_outputs_and_gradients():
    model, args = SliceExpandPool(), inputs()
    painted = convert(model, "O1", example_inputs=args, dtype=LOW, cast_placement=False)
    placed = convert(model, "O1", example_inputs=args, dtype=LOW)
    decided = rules(placed)
    moved = {name: rule for name, (_, rule) in decided.items() if rule.startswith("placement:")}
    ops = {n.name: n.meta["amp"].get("op") for n in placed.graph.nodes}
    assert sorted(ops[name] for name in moved) == ["amax", "getitem", "max_pool2d"], moved
    add = next(n for n in placed.graph.nodes if ops[n.name] == "add" and n.meta["amp"].get("precision") == "fp32")
    assert not [a for a in add.all_input_nodes if a.meta.get("amp_role") == "cast" or "amp_cast" in str(a.target)]
    for rule in moved.values():   # "placement: 131.1 KB cast -> 8.2 KB (...)": the figure shrinks
        before, after = (float(v) * {"KB": 1e3, "MB": 1e6, "B": 1}[u]
                         for v, u in re.findall(r"([\d.]+) (KB|MB|B)\b", rule)[:2])
        assert after < before, rule
    counts = placed.meta["amp"]["pass_counts"]["decide_precision"]
    assert counts["bytes_cast_after"] < counts["bytes_cast_before"] and counts["nodes_moved"] == 3
    assert runtime_cast_bytes(placed, args) < runtime_cast_bytes(painted, args) / 4   # measured, not predicted
    out_painted, grads_painted = gradients(painted, model, args)
    out_placed, grads_placed = gradients(placed, model, args)
    torch.testing.assert_close(out_placed, out_painted, rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(grads_placed, grads_painted):
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())


def test_a_forced_node_is_never_moved():
    model, args = SliceExpandPool(), inputs()
    painted = convert(model, "O1", example_inputs=args, dtype=LOW, cast_placement=False)
    pool = next(n.name for n in painted.graph.nodes if n.meta["amp"].get("op") == "max_pool2d")
    forced = convert(model, "O1", example_inputs=args, dtype=LOW, force_low=(pool,))
    dtype, rule = rules(forced)[pool]
    assert dtype == "bfloat16" and not rule.startswith("placement:"), rule
    assert rules(convert(model, "O1", example_inputs=args, dtype=LOW))[pool][1].startswith("placement:")


def _view(**nodes):
    import networkx as nx
    view = nx.DiGraph()
    for name, (op_class, precision) in nodes.items():
        view.add_node(name, op_class=op_class, precision=precision, rule="painted", reason="", forced=None)
    return view


def test_a_clear_op_goes_low_only_when_its_input_is_low_anyway_or_its_readers_go_low():
    # src -> expand (fp32) -> readers. From a low producer nothing new is rounded: the expand goes low and
    # no byte is cast. From an fp32 producer with an fp32 reader, going low would round what it reads: stays.
    cases = (("allow", "low", ["mm"], "low", (16 + 4096, 0)),
             ("deny", "fp32", ["add", "mm"], "fp32", (4096, 4096)))
    for producer_class, producer_precision, readers, expected, (before, after) in cases:
        view = _view(src=(producer_class, producer_precision), expand=("clear", "fp32"), add=("infer", "fp32"),
                     mm=("allow", "low"))
        flow = ValueFlow(value_bytes={"src": 16, "expand": 4096, "add": 4096, "mm": 4096},
                         readers={"src": ["expand"], "expand": readers, "add": [], "mm": []},
                         movable={"src", "expand", "add", "mm"})
        placement = CastPlacement(flow)
        placement(view)
        assert view.nodes["expand"]["precision"] == expected
        assert (placement.counts["bytes_cast_before"], placement.counts["bytes_cast_after"]) == (before, after)
        assert cast_bytes(flow, {n: a["precision"] for n, a in view.nodes(data=True)}) == after


def test_without_fake_values_painting_stands():
    model, args = SliceExpandPool(), inputs()
    gm = convert(model, "O1", dtype=LOW)   # no example inputs: no sizes
    assert not any(rule.startswith("placement:") for _, rule in rules(gm).values())


def test_the_cut_moves_a_chain_that_one_flip_at_a_time_cannot():
    # x (fp32 input) -> view (low) -> slice (low) -> mm (low): flipping the view alone, or the slice alone,
    # casts as much as before; flipping both casts the slice's 256 bytes instead of x's 4096.
    def placed(method):
        view = _view(reshape=("clear", "low"), slice=("clear", "low"), mm=("allow", "low"))
        flow = ValueFlow(value_bytes={"x": 4096, "reshape": 4096, "slice": 256, "mm": 256},
                         readers={"x": ["reshape"], "reshape": ["slice"], "slice": ["mm"], "mm": []},
                         fixed={"x": "fp32"}, movable={"reshape", "slice", "mm"})
        placement = CastPlacement(flow, method)
        placement(view)
        return {n: view.nodes[n]["precision"] for n in ("reshape", "slice")}, placement.counts["bytes_cast_after"]
    assert placed("greedy") == ({"reshape": "low", "slice": "low"}, 4096)
    assert placed("cut") == ({"reshape": "fp32", "slice": "fp32"}, 256)


@pytest.mark.slow
def test_convert_onnx_places_casts_with_the_same_hook_and_fewer_bytes():
    """The ONNX adapter (passes/onnx/place_casts.py) feeds the same placement: on the zoo GAT's fp32 export
    the edge gather moves to the small side, as convert() does on the fx graph (6 Casts -> 4 here)."""
    import math
    import os
    import tempfile

    import numpy as np
    import onnx_ir as ir

    from amp_compiler import convert_onnx
    from amp_compiler.onnx.export import export_fp32_reference
    from amp_compiler.onnx.sessions import make_session
    from models import build

    def casts(model: ir.Model) -> tuple[int, int]:
        nodes = [n for n in model.graph if n.op_type == "Cast"]
        return len(nodes), sum(math.prod(n.inputs[0].shape.dims) * 4 for n in nodes)

    task = build("gat", size="small")
    task.model.eval()
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "gat.onnx")
        export_fp32_reference(task.model, task.example_inputs, source)
        painted = convert_onnx(source, None, "O1", cast_placement=False)
        placed = convert_onnx(source, None, "O1")
    counts = placed.pass_counts["decide_precision"]
    assert counts["nodes_moved"] > 0 and counts["bytes_cast_after"] < counts["bytes_cast_before"]
    before, after = (casts(ir.from_proto(r.model)) for r in (painted, placed))
    assert after[0] <= before[0] and after[1] < before[1], (before, after)
    assert after[1] == counts["bytes_cast_after"]                 # the flow predicts what the file casts
    feeds = lambda session: {i.name: v.numpy() for i, v in zip(session.get_inputs(), task.example_inputs)}  # noqa
    outputs = []
    for report in (painted, placed):
        session = make_session(report.model.SerializeToString())
        outputs.append(session.run(None, feeds(session))[0])
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-2, atol=1e-2 * np.abs(outputs[0]).max())


def test_the_placement_method_is_an_option_of_the_conversion(monkeypatch):
    import pytest
    from amp_compiler.passes.fx import place_casts as fx_place_casts
    methods = []

    class Recorded(CastPlacement):
        def __init__(self, flow, method="cut"):
            methods.append(method)
            super().__init__(flow, method)

    monkeypatch.setattr(fx_place_casts, "CastPlacement", Recorded)
    model, args = SliceExpandPool(), inputs()
    for option in (True, "greedy", "cut"):
        convert(model, "O1", example_inputs=args, dtype=LOW, cast_placement=option)
    assert methods == ["cut", "greedy", "cut"]
    with pytest.raises(ValueError, match="cast_placement must be True, False or one of"):
        convert(model, "O1", example_inputs=args, dtype=LOW, cast_placement="fastest")
