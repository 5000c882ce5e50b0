"""The user's choices for one conversion, validated once: level, dtype, overrides, rules.

Levels follow Apex and MindSpore (the table: amp_compiler/passes/policy/levels.py); keyword overrides win
over the level's defaults. "auto" is O1 with fp16 where CUDA is usable, O1 with bf16 on CPU.
with_model_lists(config, model) adds what the model itself says must stay fp32 (Hugging Face's
_keep_in_fp32_modules), as the entry points that see the model call it (convert, compile_graph).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_compiler.passes.policy.fp8 import FP8_OPTION_KEYS, Fp8Options
from amp_compiler.passes.policy.levels import LEVELS, Level
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.policy.rules import PrecisionRules

LOW_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
PLACEMENT_METHODS = ("cut", "greedy")   # cast_placement="greedy": the search bench_placement.py compares
RULE_KEYS = ("allow_ops", "deny_ops", "infer_ops", "clear_ops", "force_fp32", "force_low", "custom_ops")
OVERRIDE_KEYS = ("keep_batchnorm_fp32", "cast_model_type", "dtype", "loss_scale_manager", "keep_io_types",
                 "cast_placement", *RULE_KEYS, *FP8_OPTION_KEYS)


@dataclass
class AmpConfig:
    level: str                      # O0..O3 after resolving "auto"
    requested_level: str            # what the user asked for ("auto" stays visible in the report)
    low_dtype: torch.dtype
    keep_norm_fp32: bool
    keep_io_types: bool
    loss_scale_manager: Any
    rule_options: dict = field(default_factory=dict)
    cast_placement: bool = True     # move casts at fp32 islands' edges to where fewer bytes cross (place_casts)
    placement_method: str = "cut"   # "cut": a minimum cut; "greedy": the local search benchmarks compare it with
    devices: tuple = ()             # device types the model runs on ("cpu"): ops they have no low kernel for stay fp32
    fp8: Fp8Options | None = None   # the fp8 level's options (passes/policy/fp8.py); None at the other levels
    model_keep_fp32: tuple = ()     # (module name fragment, why): the model's keep-in-fp32 lists (with_model_lists)

    @property
    def level_spec(self) -> Level:
        """The level's entry in the table: what it paints, re-classifies and defaults to."""
        return LEVELS[self.level]

    @property
    def low_dtype_name(self) -> str:
        return dtype_name(self.low_dtype)

    def precision_rules(self) -> PrecisionRules:
        return PrecisionRules.build(self.level, self.low_dtype_name, keep_norm_fp32=self.keep_norm_fp32,
                                    devices=self.devices, model_fp32=self.model_keep_fp32, **self.rule_options)


# Hugging Face PreTrainedModel attributes naming modules a family must not run low (T5's "wo"), and the low
# dtypes from_pretrained keeps them fp32 in (modeling_utils._get_dtype_plan): the plain list in float16 only.
KEEP_IN_FP32_LISTS = {"_keep_in_fp32_modules": ("float16",),
                      "_keep_in_fp32_modules_strict": ("float16", "bfloat16")}


def keep_in_fp32_modules(model: torch.nn.Module, low_dtype: torch.dtype) -> tuple[tuple[str, str], ...]:
    """(fragment, why) for every entry of the keep-in-fp32 lists of `model` and of the modules in it (a
    wrapped or composite model: each sub-model registers its own) that apply in `low_dtype`."""
    found: dict[str, str] = {}
    for module in model.modules():
        for attribute, dtypes in KEEP_IN_FP32_LISTS.items():
            entries = getattr(module, attribute, None)
            if not entries or dtype_name(low_dtype) not in dtypes or isinstance(entries, str):
                continue
            for entry in sorted(entries):
                found.setdefault(entry, f"model: {type(module).__name__}.{attribute} names {entry!r}: Hugging Face "
                                        f"keeps it fp32 in {' and '.join(dtypes)}, so does every level")
    return tuple(found.items())


def with_model_lists(config: AmpConfig, model: torch.nn.Module) -> AmpConfig:
    """`config` with the model's keep-in-fp32 lists added to those it has (a compiled child's graph adds the
    child's to the whole model's)."""
    found = dict(config.model_keep_fp32)
    for fragment, why in keep_in_fp32_modules(model, config.low_dtype) if model is not None else ():
        found.setdefault(fragment, why)
    return dataclasses.replace(config, model_keep_fp32=tuple(found.items()))


def resolve_dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in (torch.float16, torch.bfloat16):
        return value
    if isinstance(value, str) and value.lower() in LOW_DTYPES:
        return LOW_DTYPES[value.lower()]
    raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (or one of {sorted(LOW_DTYPES)}), "
                     f"got {value!r}")


FP8_LOW_DTYPES = (torch.bfloat16,)   # what runs around fp8 matmuls in torch (amp_compiler.onnx widens it)


def make_config(level: str = "O1", *, fp8_low_dtypes: tuple = FP8_LOW_DTYPES, **overrides) -> AmpConfig:
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; valid options: {', '.join(OVERRIDE_KEYS)}")
    if not isinstance(level, str) or level not in (*LEVELS, "auto"):
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, 'auto'; got {level!r}")
    requested = level
    dtype_given = overrides.get("dtype", overrides.get("cast_model_type"))
    if "dtype" in overrides and "cast_model_type" in overrides and \
            resolve_dtype(overrides["dtype"]) != resolve_dtype(overrides["cast_model_type"]):
        raise ValueError("dtype and cast_model_type disagree: give one of them")
    if level == "auto":
        level = "O1"
        if dtype_given is None:
            dtype_given = torch.float16 if torch.cuda.is_available() else torch.bfloat16
    fp8 = Fp8Options.from_overrides(overrides) if LEVELS[level].fp8_matmuls else None
    if fp8 is None and set(FP8_OPTION_KEYS) & set(overrides):
        raise ValueError(f"{sorted(set(FP8_OPTION_KEYS) & set(overrides))} apply to level 'fp8' only, not {level!r}")
    low = resolve_dtype(dtype_given if dtype_given is not None else torch.bfloat16 if fp8 else torch.float16)
    if fp8 is not None and low not in fp8_low_dtypes:   # fp8 outputs and the ops around the matmuls
        raise ValueError(f"level 'fp8' runs its other low ops in {' or '.join(map(dtype_name, fp8_low_dtypes))}: "
                         f"give dtype={' or '.join(f'torch.{dtype_name(d)}' for d in fp8_low_dtypes)} or none; "
                         f"got {dtype_name(low)}" + ("" if torch.float16 in fp8_low_dtypes else
                                                     " (export_onnx / convert_onnx write fp8 models in float16)"))
    keep_norms = overrides.get("keep_batchnorm_fp32")
    if keep_norms is not None and not isinstance(keep_norms, bool):
        raise ValueError(f"keep_batchnorm_fp32 must be True, False or None, got {keep_norms!r}")
    keep_io = overrides.get("keep_io_types", True)
    if not isinstance(keep_io, bool):
        raise ValueError(f"keep_io_types must be True or False, got {keep_io!r}")
    placement = overrides.get("cast_placement", True)
    if not isinstance(placement, bool) and placement not in PLACEMENT_METHODS:
        raise ValueError(f"cast_placement must be True, False or one of {PLACEMENT_METHODS}, got {placement!r}")
    config = AmpConfig(level=level, requested_level=requested, low_dtype=low, cast_placement=placement is not False,
                       placement_method=placement if isinstance(placement, str) else "cut",
                       keep_norm_fp32=keep_norms if keep_norms is not None else LEVELS[level].keep_norm_fp32,
                       keep_io_types=keep_io, loss_scale_manager=overrides.get("loss_scale_manager"),
                       rule_options={k: overrides[k] for k in RULE_KEYS if k in overrides}, fp8=fp8)
    config.precision_rules()  # validate user rules now, before any tracing
    return config
