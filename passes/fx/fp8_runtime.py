"""What generated code calls at the fp8 level: float8 matmuls through torch._scaled_mm, with their backward.

    fp8_linear(x, w, b, 0)          F.linear(x, w, b) on e4m3 copies of x and w, out in x's dtype (lower_fp8_matmuls)
    fp8_matmul(a, b, 0)             a @ b for a 2-D b (mm, matmul against a weight-like matrix)

The recipe is TransformerEngine's HYBRID with per-tensor current scaling:
  forward   y = (x8 @ w8^T) / (sx * sw)        x8 = sat_e4m3(x * sx), w8 = sat_e4m3(w * sw)
  backward  dx = (g8 @ w8) / (sg * sw)         g8 = sat_e5m2(dy * sg): gradients need range more than digits
            dw = (g8^T @ x8) / (sg * sx)       accumulated in fp32, returned in w's dtype
            db = sum(dy) in fp32, returned in b's dtype
Each scale is computed from the tensor it scales, on this call ("current"): the largest power of two s with
amax * s <= the format's largest finite value (448 e4m3, 57344 e5m2), divided by 2**margin. A power of two
changes only exponents, so scaling and unscaling add no rounding of their own. Casts saturate: a value past
the largest finite one (rounding can put one there when margin is 0) becomes that value, not NaN (e4m3fn has
no inf) or inf (e5m2). A tensor holding inf or NaN gets scale 0: its fp8 copy holds NaN, and so does the
product, so a loss scaler or a NaN check downstream still sees the overflow (saturation would hide it).

torch._scaled_mm has no autograd: _Fp8Matmul is the autograd.Function that supplies the two gradient matmuls.
Operand layouts are the ones cuBLASLt's fp8 GEMM takes (mat1 row-major, mat2 column-major, K and N multiples
of 16, which lower_fp8_matmuls checks); the weight gradient contracts over the tokens M, which a caller does not
choose, so M is padded with zero rows to a multiple of 16 there. The CPU runs _scaled_mm too (slowly): the
tests use it. Each helper is a `graph_leaf` (runtime.py says why); saved files name them by this module path.
"""
from __future__ import annotations

import torch

from amp_compiler.passes.fx.runtime import graph_leaf
from amp_compiler.passes.policy.fp8 import GEMM_MULTIPLE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}   # 448, 57344
AMAX_FLOOR = 1e-12   # an all-zero tensor gets a finite scale (2**48 at e4m3), not inf


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The quantizing scale for a tensor whose largest magnitude is `amax`: the largest power of two s with
    amax * s <= FP8_MAX[fp8_dtype], divided by 2**margin; 0 when amax is inf or NaN. fp32, amax's device."""
    amax = amax.float()
    headroom = FP8_MAX[fp8_dtype] / amax.clamp(min=AMAX_FLOOR)
    _, exponent = torch.frexp(headroom)   # headroom = m * 2**exponent, 0.5 <= m < 1: floor(log2) = exponent - 1
    scale = torch.ldexp(torch.ones_like(headroom), exponent - 1 - margin)
    return torch.where(torch.isfinite(amax), scale, torch.zeros_like(scale))


def saturating_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `fp8_dtype`, values past its largest finite one clamped to it (NaN stays NaN)."""
    limit = FP8_MAX[fp8_dtype]
    scaled = x.float() * scale if x.dtype == torch.float16 else x * scale   # fp16 cannot hold scales past 2**15
    return scaled.clamp(-limit, limit).to(fp8_dtype)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 copy of x, the scale that undoes it: x ~= copy * inverse) with the current per-tensor scale."""
    amax = x.detach().abs().amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
    scale = current_scale(amax, fp8_dtype, margin)
    return saturating_cast(x.detach(), scale, fp8_dtype), scale.reciprocal()


def _column_major(matrix: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (mat2 of _scaled_mm)."""
    return matrix.t().contiguous().t()


def _pad_rows(matrix: torch.Tensor, multiple: int) -> torch.Tensor:
    """`matrix` with zero rows appended up to a multiple of `multiple` rows (zero rows add nothing to a
    contraction over rows). Padded as bytes (all-zero bits are +0 in both formats): not every kernel takes fp8."""
    rows = matrix.shape[0]
    if rows % multiple == 0:
        return matrix
    padded = torch.zeros((rows + multiple - rows % multiple, *matrix.shape[1:]), dtype=torch.uint8,
                         device=matrix.device)
    padded[:rows] = matrix.view(torch.uint8)
    return padded.view(matrix.dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ w^T (+ b) with e4m3 operands; the backward's matmuls take e5m2 gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, margin: int):
        rows = x.reshape(-1, x.shape[-1])
        x8, x_unscale = quantize(rows, E4M3, margin)
        w8, w_unscale = quantize(weight, E4M3, margin)
        w8 = w8.contiguous()   # (N, K) row-major: its transpose is the column-major mat2
        out = torch._scaled_mm(x8.contiguous(), w8.t(), x_unscale, w_unscale, out_dtype=x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(x8, w8, x_unscale, w_unscale)   # fp8 copies: a quarter of fp32's memory
        ctx.margin, ctx.x_shape, ctx.dtypes = margin, x.shape, (x.dtype, weight.dtype,
                                                                 bias.dtype if bias is not None else None)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x8, w8, x_unscale, w_unscale = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_unscale = quantize(grad_rows, E5M2, ctx.margin)
        g8 = g8.contiguous()   # row-major mat1 (a gradient may arrive transposed)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:   # (M, N) @ (N, K)
            grad_x = torch._scaled_mm(g8, _column_major(w8), g_unscale, w_unscale,
                                      out_dtype=x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:   # (N, M) @ (M, K), M padded: the GEMM's contraction dim
            g_t = _pad_rows(g8, GEMM_MULTIPLE).t().contiguous()
            grad_w = torch._scaled_mm(g_t, _column_major(_pad_rows(x8, GEMM_MULTIPLE)), g_unscale, x_unscale,
                                      out_dtype=torch.float32).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = grad_rows.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None


@graph_leaf
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, margin: int = 0):
    """F.linear(x, weight, bias) as a float8 matmul (module docstring); output in x's dtype."""
    return _Fp8Matmul.apply(x, weight, bias, margin)


@graph_leaf
def fp8_matmul(a: torch.Tensor, b: torch.Tensor, margin: int = 0):
    """a @ b for a 2-D `b` (K, N) as a float8 matmul: fp8_linear with weight b^T."""
    return _Fp8Matmul.apply(a, b.t(), None, margin)
