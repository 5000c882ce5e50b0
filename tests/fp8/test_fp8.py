"""The fp8 level (issue 23, phase 1): float8 linear/matmul via torch._scaled_mm, checked on the CPU.

The error bound the matmul tests state: quantizing x to a float8 format with unit roundoff u (2**-4 e4m3,
2**-3 e5m2) and smallest subnormal d (2**-9 e4m3, 2**-16 e5m2) under scale s moves each element by at most
dx = u*|x| + (d/2)/s (the second term: values that land among the subnormals). So each product x @ w moves by
at most (|x| + dx) @ (|w| + dw) - |x| @ |w| (fp32 accumulation adds ~K*2**-24, far below), and each rounding
of a result to bfloat16 adds 2**-8 of it. The tests check every element of the output and of each gradient
against a float64 reference within that bound, and that the error is well above bfloat16's (fp8 did run).
"""
import io
import math

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.passes.fx.fp8_runtime import (E4M3, E5M2, FP8_MAX, current_scale, fp8_linear, fp8_matmul,
                                                quantize, saturating_cast)
from amp_compiler.passes.policy.fp8 import FP8_FORMATS, power_of_two_scale
from models import build

UNIT_ROUNDOFF = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SMALLEST_SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
BF16_ROUNDING = 2.0 ** -8
TRAIN_STEPS = 30
LOSS_MARGIN = 0.10   # fp8's final loss (mean of the last 5 steps) within 10% of bf16 O1's


# -- references written here, independent of fp8_runtime.py -------------------------------------------------------

def reference_scale(amax: float, fp8_dtype, margin: int = 0) -> float:
    """The largest power of two s with amax * s <= the format's max, over 2**margin; 0 for inf/NaN amax."""
    if not math.isfinite(amax):
        return 0.0
    amax, limit, scale = max(amax, 1e-12), FP8_MAX[fp8_dtype], 1.0
    while amax * scale > limit:
        scale /= 2
    while amax * scale * 2 <= limit:
        scale *= 2
    return scale / 2 ** margin


def reference_cast(values: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Round to the nearest value of the format (ties to the even code), saturating at its largest finite value."""
    codes = torch.arange(128, dtype=torch.uint8).view(fp8_dtype).double()   # the non-negative codes, in order
    grid = codes[torch.isfinite(codes)]
    magnitude = values.double().abs().clamp(max=grid[-1].item())
    upper = torch.searchsorted(grid, magnitude).clamp(max=len(grid) - 1)
    lower = (upper - 1).clamp(min=0)
    to_lower, to_upper = magnitude - grid[lower], grid[upper] - magnitude
    take_upper = (to_upper < to_lower) | ((to_upper == to_lower) & (upper % 2 == 0))
    rounded = torch.where(take_upper, grid[upper], grid[lower])
    return torch.where(torch.isnan(values), values.double(), rounded.copysign(values.double()))


def quantization_step(x: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """The most each element of x can move when quantized with its current scale (module docstring)."""
    scale = reference_scale(x.abs().max().item(), fp8_dtype)
    return UNIT_ROUNDOFF[fp8_dtype] * x.abs() + SMALLEST_SUBNORMAL[fp8_dtype] / 2 / scale


def product_bound(a, a_format, b, b_format, roundings: int) -> torch.Tensor:
    """The bound on |fp8(a) @ fp8(b) - a @ b| (float64; `roundings` to bfloat16 of the result after it)."""
    a, b = a.double(), b.double()
    moved = (a.abs() + quantization_step(a, a_format)) @ (b.abs() + quantization_step(b, b_format)) - a.abs() @ b.abs()
    return moved + roundings * BF16_ROUNDING * ((a @ b).abs() + moved) + 1e-6 * (a.abs() @ b.abs())


def assert_within(actual, reference, bound, what):
    error = (actual.double() - reference).abs()
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"{what}: an element is {worst:.2f}x the fp8 bound"
    relative = (error.norm() / reference.norm()).item()
    assert relative > 2 * BF16_ROUNDING, f"{what}: error {relative:.2e} is bfloat16's: fp8 did not run"
    # Round to nearest is unbiased: the least-squares slope of actual on reference is 1 within its noise
    # (~ relative error / sqrt(elements), 0.002 here); a scale applied wrong by 2% shows as 1.02.
    slope = ((actual.double() * reference).sum() / (reference * reference).sum()).item()
    assert abs(slope - 1) < 0.01, f"{what}: scaled by {slope:.4f}"


# -- scales and casts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
def test_current_scale_is_the_largest_power_of_two_that_fits(fp8_dtype, margin):
    special = [1.0, 448.0, 449.0, 57344.0, 3.0, 1e-3, 0.0, 1e-30, 123456.0, math.inf, math.nan]
    randoms = torch.exp(torch.empty(300).uniform_(-30, 30, generator=torch.Generator().manual_seed(0))).tolist()
    amaxes = torch.tensor(special + randoms, dtype=torch.float32)
    scales = torch.stack([current_scale(a, fp8_dtype, margin) for a in amaxes])
    expected = torch.tensor([reference_scale(a, fp8_dtype, margin) for a in amaxes.tolist()])
    torch.testing.assert_close(scales, expected, rtol=0, atol=0)
    finite = torch.isfinite(amaxes) & (amaxes > 1e-12)
    assert (amaxes[finite].double() * scales[finite] * 2 ** margin <= FP8_MAX[fp8_dtype]).all()
    assert torch.equal(torch.frexp(scales[scales > 0])[0], torch.full_like(scales[scales > 0], 0.5))   # 2**k


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 1, 30])
def test_the_plain_python_scale_is_the_runtimes_to_the_bit(fp8_dtype, margin):
    """policy/fp8.py's power_of_two_scale (the ONNX pass's weight and static scales, no torch) is current_scale
    for one amax: over the whole float32 range, at powers of two and at 448 * 2**k and one ulp either side."""
    edges = [2.0 ** e for e in range(-149, 128)] + [448 * 2.0 ** e for e in range(-140, 118)]
    randoms = torch.exp(torch.empty(2000).uniform_(-103, 88, generator=torch.Generator().manual_seed(1))).tolist()
    amaxes = [0.0, -0.0, 1e-12, 1e-13, 1e-45, 3.4e38, 3.5e38, 1e39, math.inf, math.nan, *randoms, *edges,
              *(math.nextafter(a, math.inf) for a in edges), *(math.nextafter(a, 0.0) for a in edges)]
    runtime = current_scale(torch.tensor(amaxes, dtype=torch.float32), fp8_dtype, margin).tolist()
    name = str(fp8_dtype).removeprefix("torch.")
    assert FP8_FORMATS[name] == float(torch.finfo(fp8_dtype).max) == FP8_MAX[fp8_dtype]
    plain = [power_of_two_scale(amax, name, margin) for amax in amaxes]
    assert [(a, p) for a, p, r in zip(amaxes, plain, runtime) if p != r] == []


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturating_cast_rounds_to_nearest_and_clamps(fp8_dtype):
    limit = FP8_MAX[fp8_dtype]
    edges = torch.tensor([limit, limit * 1.03, limit * 1.2, 1e9, -1e9, -limit * 1.1, 0.0, -0.0, 2.0 ** -20, math.nan])
    values = torch.cat([edges, torch.randn(2000, generator=torch.Generator().manual_seed(1)) * limit / 3])
    for scale in (1.0, 0.25):
        cast = saturating_cast(values, torch.tensor(scale), fp8_dtype)
        assert cast.dtype == fp8_dtype
        torch.testing.assert_close(cast.double(), reference_cast(values * scale, fp8_dtype), rtol=0, atol=0,
                                   equal_nan=True)
    saturated = saturating_cast(torch.tensor([1e9, -1e9]), torch.tensor(1.0), fp8_dtype).double()
    assert saturated.tolist() == [limit, -limit]   # not inf (e5m2's plain cast) nor NaN


def test_quantize_keeps_an_overflow_visible():
    # A GradScaler finds an overflow by its inf/NaN: saturation must not turn inf into the format's max.
    x = torch.tensor([1.0, float("inf"), -3.0], dtype=torch.bfloat16)
    copy, _ = quantize(x, E5M2)
    assert torch.isnan(copy.float()).any()
    out = fp8_linear(torch.tensor([[1.0] * 15 + [float("inf")]]), torch.ones(16, 16))
    assert not torch.isfinite(out).all()


# -- the autograd Function ----------------------------------------------------------------------------------------

def test_fp8_linear_forward_and_gradients_are_within_the_fp8_bound():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 10, 48, generator=gen) * 3).bfloat16().requires_grad_()   # M = 20: padded to 32 for dW
    w = (torch.randn(32, 48, generator=gen) * 0.1).bfloat16().requires_grad_()
    b = torch.randn(32, generator=gen).bfloat16().requires_grad_()
    g = (torch.randn(2, 10, 32, generator=gen) * 1e-3).bfloat16()
    y = fp8_linear(x, w, b)
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    xd, wd, bd, gd = (t.detach().double() for t in (x, w, b, g))
    rows, grads = xd.reshape(20, 48), gd.reshape(20, 32)
    assert_within(y.reshape(20, 32), rows @ wd.t() + bd, product_bound(rows, E4M3, wd.t(), E4M3, 2), "y")
    assert_within(x.grad.reshape(20, 48), grads @ wd, product_bound(grads, E5M2, wd, E4M3, 1), "dx")
    assert_within(w.grad, grads.t() @ rows, product_bound(grads.t(), E5M2, rows, E4M3, 1), "dw")
    torch.testing.assert_close(b.grad.double(), grads.sum(0), rtol=BF16_ROUNDING, atol=1e-9)   # bf16, not fp8


def test_fp8_matmul_against_a_weight_matrix():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3, 16, 32, generator=gen).bfloat16().requires_grad_()
    m = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_()
    out = fp8_matmul(a, m)
    out.backward(torch.ones_like(out))
    ad, md = a.detach().double().reshape(48, 32), m.detach().double()
    ones = torch.ones(48, 64, dtype=torch.float64)
    assert_within(out.reshape(48, 64), ad @ md, product_bound(ad, E4M3, md, E4M3, 1), "a @ m")
    # an all-ones gradient is exact in e5m2: the backward's error is the operands' e4m3 rounding alone
    assert_within(m.grad, ad.t() @ ones, product_bound(ad.t(), E4M3, ones, E5M2, 1), "dm")


# -- the level: decisions and explain -----------------------------------------------------------------------------

class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.ragged = nn.Linear(40, 32)      # K = 40: not a multiple of 16
        self.proj = nn.Linear(32, 48)
        self.mix = nn.Parameter(torch.randn(48, 32) * 0.1)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        h = self.proj(torch.relu(self.ragged(x)))
        h = torch.matmul(h, self.mix)                                      # against a 2-D weight: fp8
        scores = torch.matmul(h, h.transpose(-1, -2)).softmax(-1)         # batched: stays bf16
        return self.head(torch.matmul(scores, h))


def _rules(gm) -> dict[str, str]:
    return {row["node"]: row["rule"] for row in amp_compiler.explain(gm).rows}


def test_explain_says_which_matmuls_run_fp8_and_why_the_others_stay_bf16():
    model, x = Mixed(), torch.randn(2, 8, 40)
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16, fp8_keep=["head"])
    rules = _rules(gm)
    targets = {n.name: getattr(n.target, "__name__", n.target) for n in gm.graph.nodes}
    assert "K=40 not a multiple of 16" in rules["linear"] and targets["linear"] == "linear"
    assert rules["linear_1"].startswith("fp8 (e4m3") and targets["linear_1"] == "fp8_scaled_linear"
    assert rules["matmul"].startswith("fp8 (e4m3") and targets["matmul"] == "fp8_scaled_matmul"
    assert targets["linear_1_x_fp8"] == "fp8_cast" and targets["matmul_w_scale"] == "fp8_scale"
    assert rules["matmul_w_amax"] == "fp8 scaling of matmul's w: max |w| per tensor, float32"
    assert "a batched matmul is not lowered yet" in rules["matmul_1"]
    assert "a batched matmul is not lowered yet" in rules["matmul_2"]
    assert "user rule: fp8_keep 'head'" in rules["linear_2"]
    assert gm.meta["amp"]["pass_counts"]["lower_fp8_matmuls"] == {"fp8": 2, "kept": 4}
    model.head.register_forward_hook(lambda module, args, out: None)   # a hooked leaf stays a module call
    default = _rules(amp_compiler.convert(model, "fp8", example_inputs=(x,)))
    assert "a module call (its hooks run)" in default["amp_module_call"]
    assert "min(K=32, N=48) < fp8_min_dim 1024" in default["linear_1"]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=0.1, atol=0.05)


def test_every_other_decision_is_bf16_o1s():
    task = build("gpt", size="small")
    fp8 = amp_compiler.explain(amp_compiler.convert(task.model, "fp8", example_inputs=task.example_inputs,
                                                    fp8_min_dim=16))
    o1 = amp_compiler.explain(amp_compiler.convert(task.model, "O1", dtype=torch.bfloat16,
                                                   example_inputs=task.example_inputs))
    scaling_ops = ("fp8_amax", "fp8_scale", "fp8_cast")   # the nodes lower_fp8_matmuls adds, 3 per operand
    assert [(r["node"], r["precision"], r["dtype"]) for r in fp8.rows if r["op"] not in scaling_ops] == \
        [(r["node"], r["precision"], r["dtype"]) for r in o1.rows]
    assert sum(r["op"] in scaling_ops for r in fp8.rows) == 13 * 6
    assert sum(r["rule"].startswith("fp8 (") for r in fp8.rows) == 13   # 12 block linears + lm_head


def test_fp8_options_are_checked():
    with pytest.raises(ValueError, match="apply to level 'fp8' only"):
        amp_compiler.convert(Mixed(), "O1", fp8_margin=1, example_inputs=(torch.randn(2, 40),))
    with pytest.raises(ValueError, match="bfloat16"):
        amp_compiler.make_config("fp8", dtype=torch.float16)
    with pytest.raises(ValueError, match="fp8_margin"):
        amp_compiler.make_config("fp8", fp8_margin=-1)
    with pytest.raises(ValueError, match="fp8_scaling must be one of"):
        amp_compiler.make_config("fp8", fp8_scaling="tensorwise")
    with pytest.raises(ValueError, match=r"\['fp8_history'\] apply to fp8_scaling='delayed' only"):
        amp_compiler.make_config("fp8", fp8_history=8)
    with pytest.raises(ValueError, match="fp8_history must be at least 1"):
        amp_compiler.make_config("fp8", fp8_scaling="delayed", fp8_history=0)
    with pytest.raises(ValueError, match="fp8_max_error must be a number > 0"):
        amp_compiler.make_config("fp8", fp8_max_error=0)
    assert amp_compiler.make_config("fp8", fp8_scaling="delayed", fp8_amax_from="most_recent").fp8.amax_from == \
        "most_recent"
    with pytest.raises(ValueError, match=r"fp8_keep pattern\(s\) \['haed'\] matched no low matmul"):
        amp_compiler.convert(Mixed(), "fp8", fp8_keep=["head", "haed"], example_inputs=(torch.randn(2, 40),))


# -- training, saving, and the user's model -----------------------------------------------------------------------

def _train(name: str, level: str, **options) -> tuple[list[float], dict]:
    task = build(name, size="small")
    torch.manual_seed(0)
    gm = amp_compiler.convert(task.model, level, example_inputs=task.example_inputs, **options)
    losses = task.train_losses(gm, TRAIN_STEPS, lr=1e-2)
    return losses, gm.meta["amp"]["pass_counts"]


@pytest.mark.slow   # 6 s on 2 idle cores
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_training_at_fp8_ends_near_bf16(name):
    fp8, counts = _train(name, "fp8", fp8_min_dim=16)
    bf16, _ = _train(name, "O1", dtype=torch.bfloat16)
    assert counts["lower_fp8_matmuls"]["fp8"] >= 2
    final_fp8, final_bf16 = sum(fp8[-5:]) / 5, sum(bf16[-5:]) / 5
    assert final_fp8 < 0.5 * fp8[0], f"fp8 did not train: {fp8[0]:.3f} -> {final_fp8:.3f}"
    assert abs(final_fp8 - final_bf16) <= LOSS_MARGIN * final_bf16, (final_fp8, final_bf16)


def test_the_users_model_is_not_changed_and_the_module_saves():
    task = build("mlp", size="small")
    model = task.model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(name, type(m)) for name, m in model.named_modules()]
    x = task.example_inputs
    expected = model(*x)
    gm = amp_compiler.convert(model, "fp8", example_inputs=x, fp8_min_dim=16)
    out = gm(*x)
    assert [(name, type(m)) for name, m in model.named_modules()] == modules   # no module swapped (torchao does)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype
                                                 for k in before)
    assert torch.equal(model(*x), expected)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(*x), out)
    assert sum(getattr(n.target, "__name__", "") == "fp8_scaled_linear" for n in loaded.graph.nodes) == 2
