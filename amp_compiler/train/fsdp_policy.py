"""FSDP2's MixedPrecisionPolicy for an amp-compiler level, in one place for every launcher (Lightning's
ModelParallelStrategy, Accelerate's fsdp_version=2 plugin and the HF Trainer built on it).

The converted graphs cast the weights themselves and keep some of them fp32 (norms), so FSDP2 gathers them fp32
and reduces the gradients fp32 at O0-O2 and fp8. O3 runs every op low: there FSDP2 may gather the parameters low
(half the traffic), the shards, the optimizer and the gradient reduction staying fp32 (README's table).
"""
from __future__ import annotations

import torch

GATHERS_LOW = ("O3",)   # levels that run every op low: FSDP2 may gather their parameters low


def level_mp_policy(level: str, dtype: torch.dtype):
    """The level's MixedPrecisionPolicy: fp32 gathers and reduction, or at O3 low gathers and an fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if level in GATHERS_LOW:
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def policy_contradiction(policy, level: str, dtype: torch.dtype) -> str | None:
    """Why `policy` (a MixedPrecisionPolicy) contradicts the level, or None when it does not: a low param_dtype
    where the level keeps weights fp32, another low dtype than the level's, or an fp16 gradient reduction."""
    gathered, reduced = policy.param_dtype, policy.reduce_dtype or policy.param_dtype
    if gathered not in (None, torch.float32) and (level not in GATHERS_LOW or gathered != dtype):
        return (f"gathers the weights in {gathered}, but level {level} keeps some of them fp32 (norms)"
                if level not in GATHERS_LOW else f"gathers them in {gathered}, not the level's {dtype}")
    if reduced == torch.float16:
        return "reduces gradients in float16: scaled fp16 gradients summed over ranks overflow sooner"
    return None
