"""Coordinates computed from a grid of positions (meshgrid of aranges, RAFT's coords) stay fp32 at every
level, with the ops that read them (passes/painting/keep_coordinates_fp32.py): a small update added to a
position in low precision is rounded away (bf16 holds 64 in steps of 0.25 of a pixel... 0.5 from 128), and
`coords1 - coords0` then cancels to the rounding error. The model in miniature: RAFT's loop (issue 18)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_compiler import convert, explain
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.keep_coordinates_fp32 import carries_position

FP16, BF16 = torch.float16, torch.bfloat16
CONFIGS = [("O1", FP16), ("O1", BF16), ("O2", BF16), ("O3", FP16)]
AUTOCAST_SLACK = 2.0


class IterativeWarp(nn.Module):
    """A position per pixel from meshgrid(arange); each step samples the features at the positions
    (grid_sample), predicts a small update with a conv from the samples and the flow so far, and adds
    it to the positions. Returns the flow, coords1 - coords0."""

    def __init__(self, steps: int = 6, channels: int = 8):
        super().__init__()
        self.steps = steps
        self.encode = nn.Conv2d(3, channels, 3, padding=1)
        self.update = nn.Conv2d(channels + 2, 2, 3, padding=1)

    def forward(self, image):
        batch, _, h, w = image.shape
        features = self.encode(image)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        coords0 = torch.stack([xs, ys]).float()[None].repeat(batch, 1, 1, 1)
        coords1 = coords0
        for _ in range(self.steps):
            grid = torch.stack([2 * coords1[:, 0] / (w - 1) - 1, 2 * coords1[:, 1] / (h - 1) - 1], dim=-1)
            sampled = F.grid_sample(features, grid, align_corners=True)
            flow = coords1 - coords0
            coords1 = coords1 + 0.1 * torch.tanh(self.update(torch.cat([sampled, flow], dim=1)))
        return coords1 - coords0


class SinusoidalPositions(nn.Module):
    """sin/cos of positions x frequencies added to a linear's output: the phase reaches hundreds of radians."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.register_buffer("frequencies", 1.0 / 10.0 ** torch.linspace(0, 2, dim // 2))

    def forward(self, x):
        phase = torch.arange(x.shape[1]).float()[:, None] * self.frequencies[None]
        return self.head(self.proj(x) + torch.cat([torch.sin(phase), torch.cos(phase)], dim=-1))


def _image(size: int = 64) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


def _errors(model, level, dtype, *inputs) -> tuple[float, float, object]:
    """(ours, autocast's) max error against fp32, and the converted module."""
    gm = convert(model, level, dtype=dtype, example_inputs=inputs)
    with torch.no_grad():
        reference = model(*inputs)
        ours = (gm(*inputs).float() - reference).abs().max().item()
        with torch.autocast("cpu", dtype=dtype):
            autocast = (model(*inputs).float() - reference).abs().max().item()
    return ours, autocast, gm


@pytest.mark.slow
@pytest.mark.parametrize("level, dtype", CONFIGS, ids=[f"{lv}-{str(d)[6:]}" for lv, d in CONFIGS])
def test_iterative_warp_keeps_positions_fp32_and_is_as_accurate_as_autocast(level, dtype):
    torch.manual_seed(0)
    model, image = IterativeWarp().eval(), _image()
    ours, autocast, gm = _errors(model, level, dtype, image)
    assert ours <= AUTOCAST_SLACK * max(autocast, 1e-4), f"max error {ours:.3g}, autocast's {autocast:.3g}"
    updates = [n for n in gm.graph.nodes if facts(n).get("op") == "add" and facts(n).get("rule", "").startswith("coordinates")]
    assert len(updates) == model.steps, [(n.name, facts(n).get("rule")) for n in gm.graph.nodes if facts(n).get("op") == "add"]
    for node in updates:
        assert facts(node)["precision"] == "fp32" and facts(node)["dtype"] == torch.float32
        assert "computed from arange" in facts(node)["rule"]
    # the updates themselves still come from low-precision convs
    assert all(facts(n)["precision"] == "low" for n in gm.graph.nodes if facts(n).get("op") == "conv2d")
    assert "coordinates: a position computed from arange" in str(explain(gm, only="fp32"))


@pytest.mark.slow
def test_a_second_image_size_and_step_count():
    """The same class at another size (positions up to 95: bf16 steps of 0.5) and 3 steps."""
    torch.manual_seed(1)
    model, image = IterativeWarp(steps=3, channels=4).eval(), _image(96)
    ours, autocast, gm = _errors(model, "O1", BF16, image)
    assert ours <= AUTOCAST_SLACK * max(autocast, 1e-4), f"max error {ours:.3g}, autocast's {autocast:.3g}"


def test_sin_of_positions_reads_them_fp32_at_o2():
    torch.manual_seed(0)
    model, x = SinusoidalPositions().eval(), torch.randn(2, 300, 16)
    ours, autocast, gm = _errors(model, "O2", BF16, x)
    rules = {facts(n)["op"]: facts(n) for n in gm.graph.nodes if facts(n).get("op") in ("sin", "cos", "mul")}
    assert rules["mul"]["precision"] == "fp32" and rules["mul"]["rule"].startswith("coordinates")
    for op in ("sin", "cos"):
        assert rules[op]["precision"] == "fp32" and "reads the coordinates" in rules[op]["rule"]
    assert ours <= AUTOCAST_SLACK * autocast, f"max error {ours:.3g}, autocast's {autocast:.3g}"


def test_the_users_force_low_wins():
    torch.manual_seed(0)
    model, image = IterativeWarp(steps=2).eval(), _image(32)
    gm = convert(model, "O1", dtype=BF16, example_inputs=(image,), force_low=["add*"])
    adds = [n for n in gm.graph.nodes if facts(n).get("op") == "add"]
    assert adds and all(facts(n)["precision"] == "low" for n in adds)


def test_what_carries_a_position():
    assert all(carries_position(op) for op in ("add", "sub", "div", "mul", "clamp", "reshape", "cat", "getitem",
                                                "meshgrid", "to", "float", "floor", "where"))
    assert not any(carries_position(op) for op in ("conv2d", "grid_sample", "sin", "softmax", "zeros_like",
                                                    "lt", "argmax", "an_unknown_op", None))


class PicksRows(nn.Module):
    """arange as indices (x[arange(n), 0]): the picked values are data, not positions."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        picked = self.proj(x)[torch.arange(x.shape[0]), 0]
        return self.head(picked * 2 + 1)


def test_arange_used_as_indices_is_not_a_position():
    gm = convert(PicksRows().eval(), "O2", dtype=BF16, example_inputs=(torch.randn(3, 5, 8),))
    coordinates = [n.name for n in gm.graph.nodes if "coordinates" in (facts(n).get("rule") or "")]
    assert coordinates == []
    assert all(facts(n)["precision"] == "low" for n in gm.graph.nodes if facts(n).get("op") in ("mul", "add"))


def _onnx_positions_model():
    """x @ w gives an update; positions = Cast(Range(0, 64)) * 2 (up to 126); flow = (positions + update / 8)
    - positions, read by a second MatMul: the Add and Sub sit between two low MatMuls."""
    from onnx import TensorProto, helper
    from onnx_testing import initializer, make_model, tensor_input
    generator = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["update"], name="project"),
             helper.make_node("Range", ["start", "limit", "step"], ["index"], name="range"),
             helper.make_node("Cast", ["index"], ["index_f"], name="to_float", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["index_f", "two"], ["coords0"], name="scale"),
             helper.make_node("Div", ["update", "eight"], ["small"], name="shrink"),
             helper.make_node("Add", ["coords0", "small"], ["coords1"], name="move"),
             helper.make_node("Sub", ["coords1", "coords0"], ["flow"], name="flow"),
             helper.make_node("MatMul", ["flow", "w2"], ["y"], name="head")]
    inits = [initializer("w", generator.standard_normal((64, 64)).astype(np.float32) / 8),
             initializer("w2", generator.standard_normal((64, 8)).astype(np.float32)),
             initializer("start", np.array(0, np.int64)), initializer("limit", np.array(64, np.int64)),
             initializer("step", np.array(1, np.int64)), initializer("two", np.array(2.0, np.float32)),
             initializer("eight", np.array(8.0, np.float32))]
    model = make_model(nodes, [tensor_input("x", TensorProto.FLOAT, [4, 64])],
                       [tensor_input("y", TensorProto.FLOAT, [4, 8])], inits)
    return model, {"x": generator.standard_normal((4, 64)).astype(np.float32)}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_convert_onnx_keeps_positions_from_range_fp32(dtype):
    """The decisions only: ONNX Runtime's CPU kernels compute an fp16 Add/Sub in fp32 (it inserts casts around
    them), so the rounding this prevents shows on GPU runtimes, not here."""
    from amp_compiler import convert_onnx
    model, _ = _onnx_positions_model()
    report = convert_onnx(model, level="O1", dtype=dtype)
    rows = {r["node"]: r for r in report.rows}
    assert rows["project"]["precision"] == rows["head"]["precision"] == str(dtype)[6:]
    for name in ("scale", "move", "flow"):
        assert rows[name]["precision"] == "float32" and rows[name]["rule"].startswith("coordinates"), rows[name]
