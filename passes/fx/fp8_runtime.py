"""What generated code calls at the fp8 level: the scaling of each operand as its own nodes, then one float8
matmul through torch._scaled_mm whose backward writes the two gradient matmuls.

One lowered linear (lower_fp8_matmuls.py), as the converted module's code reads:

    linear_1_x_amax = fp8_amax(x, None)                                   max |x|, fp32 (None: per tensor)
    linear_1_x_scale = fp8_scale(linear_1_x_amax, torch.float8_e4m3fn, 0)   power of two, margin 0
    linear_1_x_fp8 = fp8_cast(x, linear_1_x_scale, torch.float8_e4m3fn)    saturating cast
    ... the same three for the weight ...
    linear_1 = fp8_scaled_linear(x, w, linear_1_x_fp8, linear_1_w_fp8, linear_1_x_scale, linear_1_w_scale, b,
                                 torch.float8_e5m2, 0, False, None, 'max')

The recipe is TransformerEngine's HYBRID:
  forward   y = (x8 @ w8^T) / (sx * sw)        x8 = sat_e4m3(x * sx), w8 = sat_e4m3(w * sw)
  backward  dx = (g8 @ w8) / (sg * sw)         g8 = sat_e5m2(dy * sg): gradients need range more than digits
            dw = (g8^T @ x8) / (sg * sx)       accumulated in fp32, returned in w's dtype
            db = sum(dy) in fp32, returned in b's dtype
A scale is the largest power of two s with amax * s <= the format's largest finite value (448 e4m3, 57344
e5m2), divided by 2**margin. A power of two changes only exponents, so scaling and unscaling add no rounding
of their own. Casts saturate: a value past the largest finite one (rounding can put one there when margin is
0; delayed scaling can put many there) becomes that value, not NaN (e4m3fn has no inf) or inf (e5m2). A
tensor holding inf or NaN gets scale 0: its fp8 copy holds NaN, and so does the product, so a loss scaler or a
NaN check downstream still sees the overflow (saturation would hide it).

Where amax comes from, by recipe (fp8_scaling):
  current   this call's tensor, one scale per tensor (fp8_scale)
  delayed   fp8_delayed_scale: the largest (amax_from="max") or the latest ("most_recent") entry of an amax
            history of the last `fp8_history` calls, one per operand and one for the gradient, held as
            persistent buffers of an Fp8History module on the GraphModule (fp8_history.<node>.x / .w / .grad:
            state_dict saves them, load_state_dict restores them, so a resumed run takes the same next scale).
            The scale is taken from the history before this call; then this call's amax is rolled in (newest
            first). A history with no entry yet (all zero: a zero amax records nothing either) scales from
            this call's own amax, so the first step needs no warm-up. A non-finite amax is not recorded (one
            overflow must not poison `fp8_history` calls) and the call gets scale 0 as above. Histories
            record only while the Fp8History module is in training mode (gm.train(); TrainStep follows the
            model's flag): an eval()/validation pass reads them and does not change training's next scales.
            The gradient's history records in backward when its forward ran in training mode. A forward
            re-run inside a backward (activation checkpointing's recomputation) records nothing and takes the
            scale the first run took for the same amax (Fp8History.issued), so checkpointing changes neither the
            histories nor the gradients.
  rowwise   torchao's "rowwise": x one scale per row (M, 1), w per row of the (N, K) weight, so _scaled_mm
            takes scale_a (M, 1) and scale_b (1, N). The backward requantizes the saved high-precision
            operands along its own contraction: dx = g @ w with g per row and w per column of K; dw = g^T @ x
            with g and x per column (per slice of M). Gradients are e4m3 here, as torchao's rowwise recipe:
            the row-wise GPU kernel (CUTLASS f8f8bf16_rowwise) multiplies e4m3 by e4m3, and per-row scales
            give each row the range e5m2 would have given the whole tensor.

torch._scaled_mm has no autograd: _Fp8Matmul is the autograd.Function that supplies the two gradient matmuls;
it takes the high-precision operands (for autograd and, row-wise, for the backward's requantization), their fp8
copies and scales. Per tensor it saves the fp8 copies (a quarter of fp32's memory). Operand layouts are the
ones cuBLASLt's fp8 GEMM takes (mat1 row-major, mat2 column-major, K and N multiples of 16, which
lower_fp8_matmuls checks); the weight gradient contracts over the tokens M, which a caller does not choose, so
M is padded with zero rows to a multiple of 16 there. Off CUDA, scaled_mm emulates _scaled_mm: the fp8 operands
upcast to fp32 (each product exact), one fp32 matmul, the unscales applied, the result cast to the output dtype;
torch 2.13's CPU _scaled_mm does the same arithmetic 20-250x slower (64x32x96: 3.6 vs 0.2 ms; 512x64x256: 150
vs 0.6 ms), which made a 200-step fp8 training test take 85 s.

fp8_linear(x, w, b, margin) and fp8_matmul(a, b, margin), phase 1's one-node forms (current scaling inside),
stay for files saved by it. Each helper is a `graph_leaf` (runtime.py says why); saved files name them by this
module path.

fp8_export_markers() are what an export_onnx graph calls instead (Fp8Options.form "export_marker"): one
opaque op per fp8 matmul, on its bf16/fp16 operands, that torch.onnx writes as a MatMul (the last section says
how). The formats' limits and the scale rule's constants are passes/policy/fp8.py's.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from amp_compiler.passes.fx.runtime import graph_leaf
from amp_compiler.passes.policy.fp8 import AMAX_FLOOR, E4M3 as E4M3_NAME, E5M2 as E5M2_NAME, FP8_EXPORT_NAMESPACE, \
    FP8_FORMATS, GEMM_MULTIPLE

E4M3, E5M2 = getattr(torch, E4M3_NAME), getattr(torch, E5M2_NAME)   # torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {getattr(torch, name): limit for name, limit in FP8_FORMATS.items()}   # 448, 57344 (torch.finfo's)
HISTORIES = ("x", "w", "grad")
ISSUED_KEPT = 256   # scales a checkpointed recomputation can replay: micro-batches accumulated before a backward


def current_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The quantizing scale for a tensor whose largest magnitude is `amax` (elementwise: one per row too): the
    largest power of two s with amax * s <= FP8_MAX[fp8_dtype], divided by 2**margin; 0 when amax is inf or
    NaN. fp32, amax's device. (policy/fp8.py's power_of_two_scale: the same for one amax, without torch.)"""
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


def amax_of(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32: of the whole tensor (dim None: 0-dim), or along `dim`, kept (-1: one per row)."""
    x = x.detach()
    if x.numel() == 0:
        shape = () if dim is None else tuple(1 if d == dim % x.dim() else s for d, s in enumerate(x.shape))
        return x.new_zeros(shape, dtype=torch.float32)
    magnitudes = x.abs()
    return (magnitudes.amax() if dim is None else magnitudes.amax(dim=dim, keepdim=True)).float()


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
             dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 copy of x, the scale that undoes it: x ~= copy * inverse) with the current scale, per tensor or
    (dim given) one per slice along `dim`."""
    scale = current_scale(amax_of(x, dim), fp8_dtype, margin)
    return saturating_cast(x.detach(), scale, fp8_dtype), scale.reciprocal()


# -- the amax histories of delayed scaling --------------------------------------------------------------------------

class Fp8History(nn.Module):
    """The amax histories of one delayed-scaled matmul: x, w and grad, each (length,) fp32, newest first.
    Persistent buffers (state_dict saves them). A zero entry is nothing recorded. Its `training` flag decides
    whether calls record (module docstring); gm.train()/eval() set it with the rest of the module."""

    def __init__(self, length: int, x_amax: float = 0.0, w_amax: float = 0.0, device=None):
        super().__init__()
        for name, start in zip(HISTORIES, (x_amax, w_amax, 0.0)):
            history = torch.zeros(length, dtype=torch.float32, device=device)
            history[0] = start   # calibration's amax: the first calls scale from it
            self.register_buffer(name, history)

    def issued(self, which: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (amax, scale) pairs recent training-mode calls took for operand `which`: a recomputation replays
        them. Not state (a module pickled before it existed has none yet)."""
        return self.__dict__.setdefault("_issued", {"x": [], "w": []})[which]

    def extra_repr(self) -> str:
        return f"length={self.x.numel()}"


def delayed_amax(history: torch.Tensor, amax: torch.Tensor, amax_from: str) -> torch.Tensor:
    """The amax a delayed scale is taken from: the history's max or newest entry; this call's `amax` while the
    history holds nothing (that entry is 0)."""
    past = history.amax() if amax_from == "max" else history[0]
    return torch.where(past > 0, past, amax.float())


def record_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Roll this call's amax into `history` (newest first) in place; a non-finite or zero amax (an empty batch:
    an expert no token reached) is not recorded: it would push a real entry out."""
    with torch.no_grad():
        amax = amax.float().reshape(1)
        rolled = torch.cat([amax, history[:-1]])
        history.copy_(torch.where(torch.isfinite(amax) & (amax > 0), rolled, history))


def _delayed(amax: torch.Tensor, history: torch.Tensor, fp8_dtype: torch.dtype, margin: int, amax_from: str,
             record: bool) -> torch.Tensor:
    scale = current_scale(delayed_amax(history, amax, amax_from), fp8_dtype, margin)
    scale = torch.where(torch.isfinite(amax), scale, torch.zeros_like(scale))   # this call's NaN stays visible
    if record:
        record_amax(history, amax)
    return scale


# -- the scaling nodes ------------------------------------------------------------------------------------------------

@graph_leaf
def fp8_amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32 (no gradient): per tensor (dim None) or along `dim`, kept: -1 one per row (..., 1),
    0 one per column (1, N)."""
    return amax_of(x, dim)


@graph_leaf
def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The current scale for `amax` (current_scale), one per element of amax."""
    return current_scale(amax, fp8_dtype, margin)


@graph_leaf
def fp8_delayed_scale(amax: torch.Tensor, histories: Fp8History, which: str, fp8_dtype: torch.dtype,
                      margin: int = 0, amax_from: str = "max") -> torch.Tensor:
    """The delayed scale of operand `which` ("x" or "w") from its history in `histories`, taken before this
    call's amax is recorded (recorded only in training mode); this call's own amax while the history is empty."""
    history = getattr(histories, which)
    if not histories.training:
        return _delayed(amax, history, fp8_dtype, margin, amax_from, record=False)
    issued = histories.issued(which)
    if _recomputing():   # checkpointing re-runs this call: no second record, the first run's scale
        return _replayed(amax, issued, _delayed(amax, history, fp8_dtype, margin, amax_from, record=False))
    scale = _delayed(amax, history, fp8_dtype, margin, amax_from, record=True)
    if not torch.compiler.is_compiling() and not is_fake(amax):   # tracing (a joint graph) keeps no fake tensors
        issued.append((amax.detach().float(), scale))
        del issued[:-ISSUED_KEPT]
    return scale


def _recomputing() -> bool:
    """True while a forward runs inside a backward: torch.utils.checkpoint recomputing it. (Under
    torch.compile the joint graph recomputes without re-running these calls.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _replayed(amax: torch.Tensor, issued: list, fallback: torch.Tensor) -> torch.Tensor:
    """The scale of the latest issued call whose amax equals `amax` (a recomputation sees the same values), else
    `fallback`; chosen on the device, without a sync."""
    issued = [(a, s) for a, s in issued if a.device == amax.device]
    if not issued:
        return fallback
    amaxes, scales = torch.stack([a for a, _ in issued]), torch.stack([s for _, s in issued])
    matches = amaxes == amax.float()
    latest = (matches * torch.arange(1, len(issued) + 1, device=amax.device)).argmax()
    return torch.where(matches.any(), scales[latest], fallback)


@graph_leaf
def fp8_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `fp8_dtype`, saturating (saturating_cast); no gradient: the matmul node carries x's."""
    return saturating_cast(x.detach(), scale, fp8_dtype)


# -- the matmul and its backward --------------------------------------------------------------------------------------

def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm(a, b, scale_a, scale_b, out_dtype) on CUDA; elsewhere the same arithmetic (module docstring).
    Scales are 0-dim, or (M, 1) for a and (1, N) for b (row-wise)."""
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    return (torch.mm(a.float(), b.float()) * scale_a * scale_b).to(out_dtype)


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


def _weight_gradient(g8: torch.Tensor, g_unscale: torch.Tensor, x8: torch.Tensor, x_unscale: torch.Tensor,
                     out_dtype: torch.dtype = torch.float32):
    """g^T @ x from fp8 (M, N) and (M, K) copies, M padded: the GEMM's contraction dim, accumulated in fp32.
    Unscales: per tensor (0-dim) or per column ((1, N) for g, (1, K) for x)."""
    g_t = _pad_rows(g8, GEMM_MULTIPLE).t().contiguous()
    scale_a = g_unscale.reshape(-1, 1) if g_unscale.dim() else g_unscale
    return scaled_mm(g_t, _column_major(_pad_rows(x8, GEMM_MULTIPLE)), scale_a, x_unscale, out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ w^T (+ b) from e4m3 copies; the backward's matmuls take fp8 gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, x8, w8, x_scale, w_scale, bias, grad_dtype, margin, rowwise, histories, amax_from):
        k, n = x.shape[-1], weight.shape[0]
        rows8 = x8.reshape(-1, k).contiguous()
        x_unscale = x_scale.reshape(-1, 1).reciprocal() if rowwise else x_scale.reciprocal()
        w_unscale = w_scale.reshape(1, -1).reciprocal() if rowwise else w_scale.reciprocal()
        w8 = w8.contiguous()   # (N, K) row-major: its transpose is the column-major mat2
        out = scaled_mm(rows8, w8.t(), x_unscale, w_unscale, x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        if rowwise:   # the backward scales along other dims: it requantizes the high-precision operands
            ctx.save_for_backward(x.detach().reshape(-1, k), weight.detach())
        else:
            ctx.save_for_backward(rows8, w8, x_unscale, w_unscale)
        ctx.recipe = (grad_dtype, margin, rowwise, histories, amax_from)
        ctx.record = histories is not None and histories.training
        ctx.x_shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype)
        ctx.bias_shape = (bias.shape, bias.dtype) if bias is not None else None
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        grad_dtype, margin, rowwise, histories, amax_from = ctx.recipe
        x_dtype, w_dtype = ctx.dtypes
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        wants_x, wants_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        if rowwise:
            x_rows, weight = ctx.saved_tensors
            if wants_x:   # (M, N) @ (N, K): g per row, w per column of K (both along N)
                g8, g_unscale = quantize(grad_rows, grad_dtype, margin, dim=-1)
                w8, w_unscale = quantize(weight, E4M3, margin, dim=0)
                grad_x = scaled_mm(g8.contiguous(), _column_major(w8), g_unscale, w_unscale,
                                   x_dtype).reshape(ctx.x_shape)
            if wants_w:   # (N, M) @ (M, K): g and x per column (along M)
                g8, g_unscale = quantize(grad_rows, grad_dtype, margin, dim=0)
                x8, x_unscale = quantize(x_rows, E4M3, margin, dim=0)
                # bf16 out: CUDA's row-wise _scaled_mm writes bf16 only (it accumulates in fp32 all the same)
                grad_w = _weight_gradient(g8, g_unscale, x8, x_unscale, torch.bfloat16).to(w_dtype)
        else:
            rows8, w8, x_unscale, w_unscale = ctx.saved_tensors
            amax = amax_of(grad_rows)
            if histories is None:
                g_scale = current_scale(amax, grad_dtype, margin)
            else:
                g_scale = _delayed(amax, histories.grad, grad_dtype, margin, amax_from, ctx.record)
            g8, g_unscale = saturating_cast(grad_rows.detach(), g_scale, grad_dtype).contiguous(), g_scale.reciprocal()
            if wants_x:   # (M, N) @ (N, K)
                grad_x = scaled_mm(g8, _column_major(w8), g_unscale, w_unscale, x_dtype).reshape(ctx.x_shape)
            if wants_w:
                grad_w = _weight_gradient(g8, g_unscale, rows8, x_unscale).to(w_dtype)
        if ctx.bias_shape is not None and ctx.needs_input_grad[6]:
            shape, dtype = ctx.bias_shape
            grad_b = grad_out.float().sum_to_size(shape).to(dtype)
        return grad_x, grad_w, None, None, None, None, grad_b, None, None, None, None, None


@graph_leaf
def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, x_fp8: torch.Tensor, w_fp8: torch.Tensor,
                      x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      grad_dtype: torch.dtype = E5M2, margin: int = 0, rowwise: bool = False,
                      histories: Fp8History | None = None, amax_from: str = "max"):
    """F.linear(x, weight, bias) from the fp8 copies and their scales (per tensor, or rowwise: x (..., 1),
    w (N, 1)); out in x's dtype. x and weight carry autograd; the backward quantizes the gradient to
    `grad_dtype` at `margin`, from `histories`.grad when delayed."""
    return _Fp8Matmul.apply(x, weight, x_fp8, w_fp8, x_scale, w_scale, bias, grad_dtype, margin, rowwise,
                            histories, amax_from)


@graph_leaf
def fp8_scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_fp8: torch.Tensor, b_fp8: torch.Tensor,
                      a_scale: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      grad_dtype: torch.dtype = E5M2, margin: int = 0, rowwise: bool = False,
                      histories: Fp8History | None = None, amax_from: str = "max"):
    """a @ b (+ bias: addmm) for a 2-D `b` (K, N): fp8_scaled_linear with weight b^T (row-wise, b's scales are
    per column (1, N))."""
    return _Fp8Matmul.apply(a, b.t(), a_fp8, b_fp8.t(), a_scale, b_scale.t() if b_scale.dim() else b_scale,
                            bias, grad_dtype, margin, rowwise, histories, amax_from)


# -- phase 1's one-node forms (saved files name them) ---------------------------------------------------------------

def _current_copies(x: torch.Tensor, weight: torch.Tensor, margin: int) -> tuple:
    x_scale = current_scale(amax_of(x), E4M3, margin)
    w_scale = current_scale(amax_of(weight), E4M3, margin)
    return (saturating_cast(x.detach(), x_scale, E4M3), saturating_cast(weight.detach(), w_scale, E4M3),
            x_scale, w_scale)


@graph_leaf
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, margin: int = 0):
    """F.linear(x, weight, bias) as a float8 matmul with current per-tensor scaling computed inside."""
    return _Fp8Matmul.apply(x, weight, *_current_copies(x, weight, margin), bias, E5M2, margin, False, None, "max")


@graph_leaf
def fp8_matmul(a: torch.Tensor, b: torch.Tensor, margin: int = 0):
    """a @ b for a 2-D `b` (K, N) as a float8 matmul: fp8_linear with weight b^T."""
    return fp8_linear(a, b.t(), None, margin)


# -- export_onnx's stand-ins ----------------------------------------------------------------------------------------

@functools.cache
def fp8_export_markers() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    """(linear, matmul): export_onnx's stand-ins for an fp8 matmul, registered on first use (torch.library takes
    some 10 ms an op: a conversion that never exports does not pay it).

    torch.onnx cannot write _scaled_mm (nor the scaling nodes' helpers): at Fp8Options.form "export_marker"
    lower_fp8_matmuls writes each matmul it lowers as one of these ops on the operands it would have quantized:
        linear(x, weight (N, K), bias, x_amax) = F.linear       matmul(a, b (K, N), bias, x_amax) = a @ b (addmm)
    torch.export keeps a custom op whole; export_onnx's translation table (amp_compiler/onnx/export.py) writes it
    as a plain MatMul (+ Add) whose metadata names the op, which the ONNX lower_fp8_matmuls finds and gives float8
    operands. Computed in the operands' dtype. x_amax: the calibrated max |x| (policy/fp8.py's NO_AMAX: none),
    which the exporter's record of the call carries to the ONNX pass. Never in a saved file: the export only."""
    @torch.library.custom_op(f"{FP8_EXPORT_NAMESPACE}::linear", mutates_args=())
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_amax: float) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    @linear.register_fake
    def _(x, weight, bias, x_amax):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.custom_op(f"{FP8_EXPORT_NAMESPACE}::matmul", mutates_args=())
    def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, x_amax: float) -> torch.Tensor:
        return torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)

    @matmul.register_fake
    def _(a, b, bias, x_amax):
        return a.new_empty((*a.shape[:-1], b.shape[-1]))

    return linear._opoverload, matmul._opoverload
