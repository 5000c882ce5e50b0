"""fp8 calibration (issue 23): convert(model, "fp8", calibration_data=...) measures each low matmul's operands
through e4m3 on the samples (passes/fx/measure_fp8_operands.py) and writes facts(node)["fp8_calibration"].

The figures are checked against a reference written here from test_fp8's reference scale and cast (not the
runtime's): per row, ||dequant(quant(v)) - v|| / ||v||, root mean square over the rows, worst sample.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler.passes.fx.measure_fp8_operands import round_trip_error
from amp_compiler.passes.node_facts import facts
from test_fp8 import E4M3, reference_cast, reference_scale

KEYS = {"samples", "x_amax", "w_amax", "x_error", "w_error", "x_error_rowwise", "w_error_rowwise"}


def reference_error(rows: torch.Tensor, rowwise: bool) -> float:
    """RMS over the non-zero rows of each row's relative e4m3 round-trip error, in float64."""
    exact = rows.double()
    if rowwise:
        scales = torch.tensor([[reference_scale(row.abs().max().item(), E4M3)] for row in exact], dtype=torch.float64)
    else:
        scales = torch.tensor(reference_scale(exact.abs().max().item(), E4M3), dtype=torch.float64)
    back = reference_cast(exact * scales, E4M3) / scales
    norms = exact.norm(dim=-1)
    kept = norms > 0
    return ((back - exact).norm(dim=-1)[kept] / norms[kept]).square().mean().sqrt().item()


def reference_figures(x: torch.Tensor, w_rows: torch.Tensor) -> dict:
    """One sample's figures; x (..., K) and w as (N, K) rows, both as the bf16 graph computes them."""
    figures = {}
    for name, rows in (("x", x.reshape(-1, x.shape[-1])), ("w", w_rows)):
        figures[f"{name}_amax"] = rows.abs().max().item()
        figures[f"{name}_error"] = reference_error(rows, rowwise=False)
        figures[f"{name}_error_rowwise"] = reference_error(rows, rowwise=True)
    return figures


def spanning_rows(rows: int, cols: int, decades: float, seed: int = 0) -> torch.Tensor:
    """randn rows scaled from 10**-decades up to 1: per-tensor scaling flushes the small ones toward zero."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * torch.logspace(-decades, 0, rows)[:, None]


class LinearThenMatmul(nn.Module):
    """A linear (weight (N, K)) and a matmul against a (K, N) parameter: both operand layouts."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.proj = nn.Parameter(torch.randn(64, 48))

    def forward(self, x):
        return torch.relu(self.fc(x)) @ self.proj


def _calibrated(gm) -> dict[str, dict]:
    return {node.name: facts(node)["fp8_calibration"] for node in gm.graph.nodes if "fp8_calibration" in facts(node)}


def _convert(model, samples, **options):
    return amp_compiler.convert(model, "fp8", example_inputs=samples[0], calibration_data=samples,
                                fp8_min_dim=16, **options)


def test_figures_are_the_reference_worst_sample():
    torch.manual_seed(0)
    model = LinearThenMatmul()
    # sample 1 has rows spanning 7 decades (its x errors are the worst), sample 2 the largest values (the amax)
    samples = [(torch.randn(2, 8, 32),), (spanning_rows(16, 32, 7).reshape(2, 8, 32),), (10 * torch.randn(2, 8, 32),)]
    gm = _convert(model, samples)
    figures = _calibrated(gm)
    assert set(figures) == {"linear", "matmul"} and all(set(f) == KEYS for f in figures.values())

    low = {name: p.detach().bfloat16() for name, p in model.named_parameters()}
    expected = {"linear": [], "matmul": []}
    for (x,) in samples:
        x = x.bfloat16()
        hidden = torch.relu(F.linear(x, low["fc.weight"], low["fc.bias"]))   # what the bf16 graph computes
        expected["linear"].append(reference_figures(x, low["fc.weight"]))
        expected["matmul"].append(reference_figures(hidden, low["proj"].t().contiguous()))   # (K, N): its columns are the rows
    for name, per_sample in expected.items():
        worst = {key: max(s[key] for s in per_sample) for key in per_sample[0]}
        assert figures[name]["samples"] == 3
        for key, value in worst.items():
            assert figures[name][key] == pytest.approx(value, rel=1e-4, abs=1e-7), (name, key)
    assert figures["linear"]["x_error"] > 0.3 > 0.04 > figures["linear"]["x_error_rowwise"]   # sample 1 is the worst
    assert figures["linear"]["x_amax"] == pytest.approx(samples[2][0].bfloat16().abs().max().item())


def test_outlier_rows_give_a_large_per_tensor_error_and_a_small_rowwise_one():
    x, w = spanning_rows(64, 32, 6), spanning_rows(32, 64, 6, seed=1)   # activation rows, weight rows (N, K)
    assert round_trip_error(x, 0) > 0.3
    assert round_trip_error(x, 0, rowwise=True) < 0.04
    assert round_trip_error(torch.randn(64, 32), 0) == pytest.approx(0.026, abs=0.006)   # e4m3's own, no outliers

    class OutlierWeights(nn.Module):   # x @ proj with proj (K, N) whose columns (outputs) span 6 decades
        def __init__(self):
            super().__init__()
            self.proj = nn.Parameter(w.t().contiguous())

        def forward(self, x):
            return x @ self.proj

    figures = _calibrated(_convert(OutlierWeights(), [(torch.randn(4, 64),)]))["matmul"]
    assert figures["w_error"] > 0.3 and figures["w_error_rowwise"] < 0.04   # rows of w as (N, K): proj's columns
    assert figures["x_error"] < 0.04


def test_non_finite_and_zero_operands():
    assert round_trip_error(torch.tensor([[1.0, math.inf]]), 0) == math.inf
    assert round_trip_error(torch.tensor([[1.0, math.nan]]), 0, rowwise=True) == math.inf
    assert round_trip_error(torch.zeros(4, 16), 0) == 0.0


def test_no_calibration_data_no_figures():
    torch.manual_seed(0)
    model, samples = LinearThenMatmul(), [(torch.randn(2, 8, 32),)]
    gm = amp_compiler.convert(model, "fp8", example_inputs=samples[0], fp8_min_dim=16)
    assert _calibrated(gm) == {} and "measure_fp8_operands" not in gm.meta["amp"]["pass_counts"]
    o1 = amp_compiler.convert(model, "O1", example_inputs=samples[0], calibration_data=samples, dtype=torch.bfloat16)
    assert _calibrated(o1) == {}   # the fp8 level's analysis only


class FunctionalDropout(nn.Module):
    """F.dropout(training=self.training): fx bakes the flag in at capture (True for a model in training mode)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(F.dropout(x, 0.5, training=self.training))


def test_calibration_measures_as_eval_mode_where_dropout_was_baked_in_training():
    torch.manual_seed(0)
    samples = [(torch.randn(16, 32),) for _ in range(2)]
    model = FunctionalDropout().train()
    state = torch.get_rng_state()
    gm = amp_compiler.convert(model, "fp8", example_inputs=samples[0], fp8_min_dim=16, calibration_data=samples)
    figures = facts(next(n for n in gm.graph.nodes if n.name == "linear"))["fp8_calibration"]
    want = max(x.abs().max().item() for (x,) in samples)   # no dropout: the samples' own amax (bf16-rounded)
    assert figures["x_amax"] == pytest.approx(want, rel=2 ** -8)   # dropout (x2 kept values) would double it
    assert torch.equal(torch.get_rng_state(), state)   # neither calibration (ranges, fp8) draws from the RNG


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc(x))))


def test_an_analysis_the_graph_and_the_users_model_are_unchanged():
    torch.manual_seed(0)
    model = WithBatchNorm().train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    samples = [(torch.randn(8, 32) * (i + 1),) for i in range(4)]
    calibrated = _convert(model, samples)
    plain = amp_compiler.convert(model, "fp8", example_inputs=samples[0], fp8_min_dim=16)
    assert calibrated.meta["amp"]["pass_counts"]["measure_fp8_operands"] == {"samples": 4, "measured": 2}
    assert set(_calibrated(calibrated)) == {"linear", "linear_1"}
    assert calibrated.code == plain.code   # the pass rewrote nothing
    for name, value in model.state_dict().items():   # batch norm statistics too: calibration runs in eval mode
        assert torch.equal(value, before[name]), name
    assert model.training and calibrated.training and all(m.training for m in calibrated.modules())
    calibrated.eval(), plain.eval()
    x = torch.randn(8, 32)
    assert torch.equal(calibrated(x), plain(x))


def test_a_generator_is_refused_with_what_to_pass():
    torch.manual_seed(0)
    model = LinearThenMatmul()
    samples = [(torch.randn(2, 8, 32),) for _ in range(2)]
    with pytest.raises(ValueError, match="generator"):
        amp_compiler.convert(model, "fp8", example_inputs=samples[0], calibration_data=(s for s in samples),
                             fp8_min_dim=16)


# -- end to end: lower_fp8_matmuls reads the figures (keep rule, delayed histories) ---------------------------------

class OneOutlierInput(nn.Module):
    """Three linears; `outlier` alone reads y, whose rows the samples make span 7 decades."""

    def __init__(self):
        super().__init__()
        self.first, self.outlier, self.last = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x, y):
        return self.last(torch.relu(self.first(x)) + self.outlier(y))


def _outlier_samples(count: int) -> list[tuple]:
    return [(torch.randn(16, 32, generator=torch.Generator().manual_seed(i)), spanning_rows(16, 32, 7, seed=i))
            for i in range(count)]


def test_the_linear_fed_outlier_rows_stays_bf16_with_its_figures_the_others_run_fp8():
    torch.manual_seed(0)
    model, samples = OneOutlierInput(), _outlier_samples(4)
    gm = _convert(model, samples)
    rows = {facts(n).get("module"): (n, facts(n)) for n in gm.graph.nodes if facts(n).get("family") == "matmul"}
    node, amp = rows["outlier"]
    figures = amp["fp8_calibration"]
    assert figures["x_error"] > 0.1 and figures["samples"] == 4
    assert f"fp8: kept bfloat16: calibrated e4m3 error x {figures['x_error']:.3g}" in amp["rule"]
    assert "> fp8_max_error 0.1" in amp["rule"]
    assert "fp8" not in str(node.target)
    for module in ("first", "last"):
        node, amp = rows[module]
        assert "fp8_scaled_linear" in str(node.target) and amp["rule"].startswith("fp8 ("), amp["rule"]
        assert "<= 0.1" in amp["rule"]
    assert gm.meta["amp"]["pass_counts"]["lower_fp8_matmuls"] == {"fp8": 2, "kept": 1}
    # row-wise scaling keeps the outlier rows' digits: all three run fp8
    rowwise = _convert(model, samples, fp8_scaling="rowwise")
    assert rowwise.meta["amp"]["pass_counts"]["lower_fp8_matmuls"] == {"fp8": 3, "kept": 0}
    # a looser fp8_max_error lets it through
    loose = _convert(model, samples, fp8_max_error=figures["x_error"] * 1.01)
    assert loose.meta["amp"]["pass_counts"]["lower_fp8_matmuls"]["fp8"] == 3


class _ScaleRecorder(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, node):
        result = super().run_node(node)
        self.values[node.name] = result
        return result


def test_delayed_scaling_first_call_scales_from_the_calibrated_amax():
    torch.manual_seed(0)
    model, samples = LinearThenMatmul(), [(8 * torch.randn(2, 8, 32),) for _ in range(3)]
    gm = _convert(model, samples, fp8_scaling="delayed").eval()
    figures = _calibrated(gm)["linear"]
    history = gm.fp8_history.linear
    assert history.x[0].item() == figures["x_amax"] and history.w[0].item() == figures["w_amax"]
    call = torch.randn(2, 8, 32) / 16   # its own amax is far below the samples': its own scale would be 2**6 larger
    recorder = _ScaleRecorder(gm)
    with torch.no_grad():
        recorder.run(call)
    x_scale = recorder.values["linear_x_scale"].item()
    assert x_scale == reference_scale(figures["x_amax"], E4M3)
    assert x_scale < reference_scale(call.bfloat16().abs().max().item(), E4M3) / 16
    assert recorder.values["linear_w_scale"].item() == reference_scale(figures["w_amax"], E4M3)   # the weight's own too
