"""measure_fp8_operands: with calibration_data at the fp8 level, how well each matmul's operands survive e4m3.

    convert(model, "fp8", calibration_data=[(x1,), (x2,), ...])
    facts(node)["fp8_calibration"] = {"samples": 8, "x_amax": 31.5, "w_amax": 0.42,
                                      "x_error": 0.21, "w_error": 0.026,
                                      "x_error_rowwise": 0.027, "w_error_rowwise": 0.025}

An analysis: it runs the graph on the samples (fx.Interpreter, eval mode, no grad) and changes nothing. It runs
after every bf16 decision and before lower_fp8_matmuls, so each decided-low linear/matmul/mm is measured on the
bf16 operands the fp8 rewrite would quantize: every call form lower_fp8_matmuls reads operands from (its
matmul_operands: linear, matmul, mm, addmm); x: the activation, w: the weight in the call's own layout, 2-D (a
batched second operand is not measured: it is not lowered). Per operand:
  *_amax           the largest finite |value| over all samples (delayed scaling starts its history from it)
  *_error          the e4m3 round trip's relative error ||dequant(quant(v)) - v|| / ||v|| of each row, root mean
                   square over the rows, with one power-of-two scale for the tensor (fp8_runtime.current_scale at
                   fp8_margin, then saturating_cast: what the runtime does); the worst sample
  *_error_rowwise  the same with one scale per row
Rows: those of x (its leading dims flattened: one per token) and of w as the linear's (N, K) weight (one per
output; a matmul's (K, N) operand: its columns). Why per row: one relative Frobenius norm over the whole tensor
is the largest rows' error (2.6% for e4m3) even when per-tensor scaling flushes every row 10^6 below the largest
to zero; each row is a token's (or an output's) own result, so each counts alike here.
A tensor holding inf or NaN has error inf (its fp8 copy would be NaN). lower_fp8_matmuls reads the figures: a
node whose error at its recipe's granularity exceeds fp8_max_error stays bf16 (outlier rows), and delayed
histories start from the amax. The samples are iterated a second time (range calibration ran them first):
calibration_data must be a list or another re-iterable, not a generator.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.fx as fx

from amp_compiler.passes.fx.calibrate_ranges import EvalModeInterpreter
from amp_compiler.passes.fx.fp8_runtime import E4M3, current_scale, saturating_cast
from amp_compiler.passes.fx.lower_fp8_matmuls import matmul_operands
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.calibrate_ranges import calibration_sample, check_calibration_data, progress
from amp_compiler.passes.runner import PassResult


def round_trip_error(rows: torch.Tensor, margin: int, rowwise: bool = False) -> float:
    """The e4m3 round trip's relative error of each row of the 2-D `rows`, root mean square over the rows
    (all-zero rows left out), with one scale for the tensor or, rowwise, one per row. inf when a value is inf or
    NaN (the fp8 copy would be NaN); 0 for an all-zero tensor."""
    exact = rows.detach().float()
    if not bool(exact.isfinite().all()):
        return float("inf")
    magnitudes = exact.abs()
    amax = magnitudes.amax(dim=-1, keepdim=True) if rowwise else magnitudes.amax()
    scale = current_scale(amax, E4M3, margin)
    back = saturating_cast(rows.detach(), scale, E4M3).float() / scale   # powers of two: unscaling is exact
    norms = torch.linalg.vector_norm(exact, dim=-1)
    errors = torch.linalg.vector_norm(back - exact, dim=-1)[norms > 0] / norms[norms > 0]
    return float(errors.square().mean().sqrt()) if errors.numel() else 0.0


def operand_figures(x: torch.Tensor, w: torch.Tensor, margin: int, as_linear: bool) -> dict[str, float]:
    """One sample's figures of a matmul's operands (module docstring); w in the call's layout, 2-D."""
    figures = {}
    for name, rows in (("x", x.reshape(-1, x.shape[-1])), ("w", w if as_linear else w.t())):   # w as (N, K)
        finite = rows.detach().abs().float()
        finite = finite[finite.isfinite()]
        figures[f"{name}_amax"] = float(finite.max()) if finite.numel() else 0.0
        figures[f"{name}_error"] = round_trip_error(rows, margin)
        figures[f"{name}_error_rowwise"] = round_trip_error(rows, margin, rowwise=True)
    return figures


def measure_fp8_operands(gm: fx.GraphModule, samples: Iterable, margin: int) -> PassResult:
    """facts(node)["fp8_calibration"] on every decided-low linear/matmul/mm/addmm node with a 2-D second operand.
    Counts: samples, measured (nodes given figures)."""
    check_calibration_data(samples)
    matmuls = {}
    for node in gm.graph.nodes:
        amp = facts(node)
        if amp.get("family") == "matmul" and amp.get("precision") == "low":
            operands = matmul_operands(node)
            if operands is not None and all(isinstance(v, fx.Node) for v in operands[:2]):
                matmuls[node] = operands
    if not matmuls:
        return PassResult(modified=False, counts={"samples": 0, "measured": 0})
    recorder = _OperandRecorder(gm, matmuls, margin)
    arity = sum(node.op == "placeholder" for node in gm.graph.nodes)
    with _evaluating(gm):
        bar = progress(samples)
        bar.set_description("calibrating fp8 operands")
        for index, sample in enumerate(bar):
            recorder.run(*calibration_sample(index, sample, arity))
            recorder.samples += 1
    if recorder.samples == 0:
        raise ValueError("calibration_data gave no samples to the fp8 calibration: it is read twice (ranges, then "
                         "fp8 operands), so pass a list of input tuples rather than a generator")
    for node, figures in recorder.worst.items():
        facts(node)["fp8_calibration"] = {"samples": recorder.samples, **figures}
    return PassResult(modified=False, counts={"samples": recorder.samples, "measured": len(recorder.worst)})


@contextlib.contextmanager
def _evaluating(gm: fx.GraphModule):
    """Eval mode (batch norm statistics stay as they are, no dropout) and no grad; the modes restored after."""
    flags = {module: module.training for module in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags.items():
            module.training = flag


class _OperandRecorder(EvalModeInterpreter):
    """Measures each watched matmul's operands as the node is about to run; keeps the worst figures so far."""

    def __init__(self, gm: fx.GraphModule, matmuls: dict, margin: int):
        super().__init__(gm)
        self.matmuls, self.margin, self.samples, self.worst = matmuls, margin, 0, {}

    def run_node(self, node: fx.Node):
        operands = self.matmuls.get(node)
        if operands is not None:
            x, w = self.env[operands[0]], self.env[operands[1]]
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2:
                figures = operand_figures(x, w, self.margin, as_linear=operands[3])
                worst = self.worst.setdefault(node, figures)
                for key, value in figures.items():   # amax: the largest; errors: the worst sample
                    worst[key] = max(worst[key], value)
        return super().run_node(node)
