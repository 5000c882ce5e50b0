"""The numerics vocabulary beside the op policy table: the low dtypes' limits, one spelling of a dtype, and
every set of op names (or module types) a pass decides precision by outside op_policy.py.

    FP16_MAX, BF16_MAX                  65504.0, 3.3895e+38: the largest finite numbers the low dtypes hold
    low_max("bfloat16")                 the same, for the dtype a conversion lowers to
    dtype_name(torch.float16)           "float16" (onnx_ir's FLOAT16 too; FLOAT -> "float32"; None -> "-")
    ROUTING_CHOICES_WITH_INDICES        {"topk", "sort", ...}: what fx/routing.py keeps fp32

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
