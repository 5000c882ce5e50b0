"""The fp8 level's options and the rules that decide which matmuls qualify: one place, read by both formats.

    convert(model, "fp8", fp8_scaling="delayed", fp8_history=16, fp8_margin=1, fp8_keep=["lm_head"])

The fx rewrite (passes/fx/lower_fp8_matmuls.py) and the ONNX one read the same options and the same size
rule, so a matmul that trains in fp8 is the one exported in fp8. Scaling recipes:

    current    per tensor, from the tensor itself on each call (TransformerEngine's Float8CurrentScaling,
               torchao "tensorwise")
    delayed    per tensor, from the largest amax in a history of the last `fp8_history` calls (or the most
               recent one: fp8_amax_from="most_recent"); histories are buffers, saved in checkpoints
               (TransformerEngine's DelayedScaling). A history with nothing recorded yet scales from the
               tensor itself, so the first step needs no warm-up; only training-mode calls record
               (gm.train()): a validation pass in eval() leaves training's next scales as they were
    rowwise    one scale per row of x and of w (torchao "rowwise"): rows that span decades keep their digits;
               gradients e4m3 with one scale per row/column (torchao's: the row-wise GPU kernel is e4m3 x e4m3)

Scales are powers of two divided by 2**fp8_margin. fp8_max_error applies with calibration_data: a matmul
whose operands' fp8 round-trip error on the samples exceeds it stays bf16 (outlier rows).

The formats' facts both rewrites share live here too, in plain Python (the ONNX pass imports no torch): each
format's largest finite value (FP8_FORMATS, by the name torch and ml_dtypes give the dtype), the scale rule
(power_of_two_scale: fp8_runtime.current_scale's arithmetic for one amax), and how export_onnx carries the fx
pass's decision to the ONNX one (FP8_EXPORT_NAMESPACE, NO_AMAX: Fp8Options.form "export_marker").
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from amp_compiler.passes.policy.rules import string_tuple

SCALINGS = ("current", "delayed", "rowwise")
AMAX_FROM = ("max", "most_recent")
GEMM_MULTIPLE = 16   # cuBLASLt's fp8 GEMM: K, N (and the weight gradient's M) multiples of 16
# How lower_fp8_matmuls (fx) writes a matmul it lowers (Fp8Options.form; set by the entry point, not a user option):
#   scaled_mm      the scaling nodes and one fp8_scaled_linear/_matmul (_scaled_mm): what convert() runs
#   export_marker  one call of export_onnx's marker op (fp8_runtime.fp8_export_linear/_matmul) on the bf16/fp16
#                  operands, with the calibrated max |x|: torch.onnx writes it as a MatMul tagged with its origin,
#                  and the ONNX lower_fp8_matmuls gives exactly those nodes float8 operands
FP8_FORMS = ("scaled_mm", "export_marker")

# The largest finite value of each float8 format, by dtype name (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn)
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FP8_FORMATS = {E4M3: 448.0, E5M2: 57344.0}
AMAX_FLOOR = 1e-12   # an all-zero tensor gets a finite scale (2**48 at e4m3), not inf
FP8_EXPORT_NAMESPACE = "amp_compiler_fp8_onnx"   # torch.library namespace of export_onnx's marker ops
NO_AMAX = -1.0   # a marker's x_amax when convert() calibrated nothing
FP8_OPTION_KEYS = ("fp8_min_dim", "fp8_margin", "fp8_keep", "fp8_scaling", "fp8_history", "fp8_amax_from",
                   "fp8_max_error")
_DELAYED_ONLY = ("fp8_history", "fp8_amax_from")


def _non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _one_of(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


@dataclass(frozen=True)
class Fp8Options:
    """convert(model, "fp8", fp8_min_dim=..., fp8_margin=..., fp8_keep=[...], fp8_scaling=..., ...)."""
    min_dim: int = 1024            # min(K, N) below this stays bf16 (size_rule says why)
    margin: int = 0                # scales are divided by 2**margin: headroom for values past the measured amax
    keep: tuple[str, ...] = ()     # node names / module paths (glob patterns) that stay bf16
    scaling: str = "current"       # SCALINGS
    history: int = 16              # delayed: calls the amax history holds (MS-AMP's window; TE defaults to 1024)
    amax_from: str = "max"         # delayed: the history's max, or its most recent entry
    max_error: float = 0.1         # calibration: fp8 round-trip error (relative, Frobenius) above which bf16 stays
    form: str = "scaled_mm"        # FP8_FORMS: what the fx pass writes (export_onnx asks for "export_marker")

    @classmethod
    def from_overrides(cls, overrides: dict) -> "Fp8Options":
        get = lambda key, default: overrides.get(key, default)  # noqa: E731
        scaling = _one_of("fp8_scaling", get("fp8_scaling", cls.scaling), SCALINGS)
        misplaced = [key for key in _DELAYED_ONLY if key in overrides and scaling != "delayed"]
        if misplaced:
            raise ValueError(f"{misplaced} apply to fp8_scaling='delayed' only, not {scaling!r}")
        history = _non_negative_int("fp8_history", get("fp8_history", cls.history))
        if history < 1:
            raise ValueError("fp8_history must be at least 1 (the calls a delayed scale is taken from)")
        max_error = get("fp8_max_error", cls.max_error)
        if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not max_error > 0:
            raise ValueError(f"fp8_max_error must be a number > 0, got {max_error!r}")
        return cls(min_dim=_non_negative_int("fp8_min_dim", get("fp8_min_dim", cls.min_dim)),
                   margin=_non_negative_int("fp8_margin", get("fp8_margin", cls.margin)),
                   keep=string_tuple(get("fp8_keep", ()), "fp8_keep"), scaling=scaling, history=history,
                   amax_from=_one_of("fp8_amax_from", get("fp8_amax_from", cls.amax_from), AMAX_FROM),
                   max_error=float(max_error))

    def recipe(self) -> str:
        """The recipe in words, as explain() shows it on every fp8 matmul."""
        scaling = {"current": "per-tensor current scaling",
                   "delayed": f"per-tensor delayed scaling ({self.amax_from} of {self.history} calls' amax)",
                   "rowwise": "row-wise current scaling"}[self.scaling]
        gradients = "e4m3" if self.scaling == "rowwise" else "e5m2"   # the row-wise GPU kernel: e4m3 x e4m3
        return f"e4m3 operands -> bfloat16 via _scaled_mm, {gradients} gradients; {scaling}, power-of-two scales, " \
               f"margin {self.margin}"


def size_rule(k: int | None, n: int | None, options: Fp8Options) -> str | None:
    """Why a matmul contracting K into N outputs stays bf16 on its sizes alone, or None when they qualify.
    Both formats' rewrites ask this with the sizes they know (None: not known at conversion)."""
    if k is None or n is None:
        return "K or N is a dynamic size: its multiple of 16 cannot be checked at conversion"
    ragged = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % GEMM_MULTIPLE]
    if ragged:
        return f"{', '.join(ragged)} not a multiple of {GEMM_MULTIPLE} (fp8 GEMM kernels need K and N multiples of 16)"
    if min(k, n) < options.min_dim:
        return (f"min(K={k}, N={n}) < fp8_min_dim {options.min_dim}: the amax and fp8 casts of x, w and the gradient "
                "would cost about what the faster GEMM saves")
    return None


def _float32(value: float) -> float:
    """`value` rounded to float32 (inf beyond its range), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def power_of_two_scale(amax: float, fp8_format: str = E4M3, margin: int = 0) -> float:
    """The quantizing scale for a tensor whose largest magnitude is `amax`: the largest power of two s with
    amax * s <= FP8_FORMATS[fp8_format], divided by 2**margin; 0.0 when amax is inf or NaN. The arithmetic of
    fp8_runtime.current_scale (float32: amax rounded to it and floored at AMAX_FLOOR, the headroom divided in
    it), for one amax in plain Python: the same scale to the bit (tests/fp8/test_fp8.py)."""
    amax = _float32(amax)
    if not math.isfinite(amax):
        return 0.0
    headroom = _float32(FP8_FORMATS[fp8_format] / max(amax, _float32(AMAX_FLOOR)))   # correctly rounded
    _, exponent = math.frexp(headroom)   # headroom = m * 2**exponent, 0.5 <= m < 1: floor(log2) = exponent - 1
    return _float32(2.0 ** (exponent - 1 - margin))
