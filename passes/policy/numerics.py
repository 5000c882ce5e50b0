"""The numerics vocabulary beside the op policy table: the low dtypes' limits, one spelling of a dtype, and
every set of op names (or module types) a pass decides precision by outside op_policy.py.

    FP16_MAX, BF16_MAX                  65504.0, 3.3895e+38: the largest finite numbers the low dtypes hold
    low_max("bfloat16")                 the same, for the dtype a conversion lowers to
    dtype_name(torch.float16)           "float16" (onnx_ir's FLOAT16 too; FLOAT -> "float32"; None -> "-")
    ROUTING_WITH_INDICES                {"topk", "sort", ...}: choices fx/routing.py keeps fp32, with their scores

Whoever adds an op reads two files: op_policy.py (its class, family and reason) and this one (the passes
that single it out by name). Pure data plus small functions; the passes decide.
"""
from __future__ import annotations

import torch
from torch import nn

# --- the low dtypes' limits
FP16_MAX = float(torch.finfo(torch.float16).max)    # 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)   # 3.3895e+38: fp32's exponent range, 8 bits of mantissa


def low_finfo(low_dtype) -> torch.finfo:
    """finfo of a low dtype given as a torch dtype or its name ("float16", "bfloat16")."""
    return torch.finfo(getattr(torch, low_dtype) if isinstance(low_dtype, str) else low_dtype)


def low_max(low_dtype) -> float:
    """The low dtype's largest finite number: 65504 for float16, 3.39e38 for bfloat16."""
    return low_finfo(low_dtype).max


# --- one spelling of a dtype, for reports, rules, cast names and errors
_ONNX_NAMES = {"FLOAT": "float32", "FLOAT16": "float16", "BFLOAT16": "bfloat16"}   # onnx_ir.DataType names


def dtype_name(dtype) -> str:
    """torch.float16 -> "float16"; an onnx_ir DataType: FLOAT -> "float32", FLOAT16 -> "float16", others their
    name in lower case (DOUBLE -> "double"); None (no dtype recorded) -> "-"."""
    if dtype is None:
        return "-"
    if not isinstance(dtype, torch.dtype) and isinstance(getattr(dtype, "name", None), str):
        return _ONNX_NAMES.get(dtype.name, dtype.name.lower())
    return str(dtype).removeprefix("torch.")


SHORT_NAMES = {"float16": "fp16", "bfloat16": "bf16"}   # as rules and warnings abbreviate the low dtypes


def short_name(low_dtype: str) -> str:
    """"float16" -> "fp16", "bfloat16" -> "bf16"; other names as given."""
    return SHORT_NAMES.get(low_dtype, low_dtype)


# --- op names (canonical, as op_policy.py keys them) and module types that passes single out; each line says
# which pass reads the set and why its members are different from the rest of their policy class.

# fx/canonicalize.py: Python's in-place operators (h += y) write their first operand; painting sets them aside
IN_PLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                                "ixor", "imatmul"})
# fx/decide_precision.py: in-place ops (with the policy's "activation" family) whose only float operand is the
# tensor they write: painting joins their readers to it (bn -> relu_ -> conv paints as bn -> conv)
UNARY_IN_PLACE_OPS = frozenset({"relu", "relu6", "dropout", "hardtanh"})
# fx/calibrate_ranges.py (and measure_fp8_operands): dropouts whose `training` flag fx baked in at capture;
# calibration runs them as eval mode does (their input), drawing nothing from the RNG
DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})
# fx/out_of_place_activations.py (export_onnx): in-place activation modules made out of place, so that painting
# does not cut conv -> relu_ -> conv chains; exact types: the forward is torch.nn's own
ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.SiLU, nn.Mish,
                      nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.Threshold)
# fx/promote_in_kernel.py: binary ops whose type promotion upcasts a low operand as the kernel reads it (exact)
PROMOTING_OPS = frozenset({"add", "sub", "mul", "div"})
# fx/cast_after_layout_ops.py: views that only reorder dims: a cast after one writes the row-major copy
LAYOUT_OPS = frozenset({"transpose", "permute", "t", "swapaxes", "movedim"})
# fx/cast_after_layout_ops.py: matmuls whose CPU kernels take a slow strided path on a transposed low input
MATMUL_OPS = frozenset({"linear", "matmul"})

# fx/routing.py: a discrete choice made from scores keeps them fp32 (two close scores must not swap)
ROUTING_INDICES_ONLY = frozenset({"argmax", "argmin", "argsort"})              # the output is the indices
ROUTING_WITH_INDICES = frozenset({"topk", "sort", "kthvalue", "max", "min"})   # (values, indices): output 1
ROUTING_SCORE_OPS = frozenset({"softmax", "log_softmax"})   # keep the order of the scores they normalise
# fx/routing.py: scatter-adds sum partial results into a buffer, which stays fp32 (a low one rounds every sum)
SCATTER_ADDS = frozenset({"index_add", "scatter_add", "scatter_reduce", "index_reduce"})
# fx/routing.py: token counts stay fp32 (bf16 holds integers exactly only up to 256)
COUNTS = frozenset({"histc", "bincount"})
# fx/routing.py, painting/keep_coordinates_fp32.py: a tensor shaped like its input, not computed from its values
FACTORIES_LIKE = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like"})

# painting/keep_coordinates_fp32.py: positions start here and stay fp32 through arithmetic and data movement
COORDINATE_SOURCES = frozenset({"arange", "linspace"})
# painting/keep_coordinates_fp32.py: read coordinates as their grid, not as their data, and stay fp32
COORDINATE_SAMPLERS = frozenset({"grid_sample", "grid_sampler"})
# onnx/coordinates.py: variadic ops (Concat, Max, Min) read every input as data, not only input 0
EVERY_INPUT_IS_DATA = frozenset({"cat", "max", "min", "maximum", "minimum"})
# painting/keep_phases_fp32.py: periodic ops whose argument (a phase) stays fp32 (bf16 holds 1000 in steps of 4)
PERIODIC_OPS = frozenset({"sin", "cos"})

# painting/keep_norms_fp32.py: a norm written by hand (Llama's RMSNorm, T5LayerNorm, BERT's LayerNorm in older
# code) is these ops in a row; found by shape, the level's norm rule keeps them fp32 as it keeps nn.LayerNorm
NORM_SQUARES = frozenset({"pow", "square"})            # x.pow(2) (or mul(x, x)): the second moment's square
NORM_MEANS = frozenset({"mean"})                       # .mean(-1, keepdim=True): the moment (and the centre)
NORM_SPREADS = frozenset({"var", "std"})               # x.var(-1, unbiased=False), x.std(-1): the moment at once
NORM_ROOTS = frozenset({"sqrt", "rsqrt"})              # the root of the moment
NORM_MAGNITUDES = frozenset({"norm", "vector_norm"})   # ||x|| at once (ScaleNorm: g * x / ||x||): a rooted moment
NORM_STATISTIC_STEPS = frozenset({"add", "clamp", "clamp_min", "reciprocal", "div"})   # + eps, 1 / root
NORM_NORMALISERS = frozenset({"mul", "div"})           # x * rsqrt(...), (x - mean) / sqrt(...)
NORM_CENTRING = frozenset({"sub"})                     # x - x.mean(-1, keepdim=True): a LayerNorm, not an RMSNorm

# painting/keep_upcasts_fp32.py: the model's own casts; one to float32 of a float value is an upcast the model
# asks for (LlamaRMSNorm's hidden_states.to(torch.float32)), honoured at every level as autocast and Apex O2 do
USER_CASTS = frozenset({"to", "float", "type", "type_as", "double", "half", "bfloat16"})
