"""convert_onnx(): an existing fp32 ONNX file to mixed precision, with the rules convert() uses for training.

    load -> unique names -> sort -> canonicalize -> type the source -> strip float casts -> decide
         -> insert casts -> ONNX_FINISH_PIPELINE (export_onnx's tail too: store moved weights low, fold casts,
            store tied weights once, (lower graph inputs), re-infer types, sort) -> save

The same policy table (passes/policy/op_policy.py), the same PrecisionRules and the same paint_precision decide;
only the view builder and the rewrite are ONNX-specific.
"""
from __future__ import annotations

import os
import time

import onnx
import onnx_ir as ir
import torch

from amp_compiler.config import AmpConfig, make_config
from amp_compiler.onnx.files import (check_writable, copy_onnx_file, has_external_tensors, has_float_tensors,
                                     load_onnx_model, save_onnx_model, weight_bytes)
from amp_compiler.onnx.progress import PROGRESS_AFTER_SECONDS, ConversionProgress, announcing  # noqa: F401 (old home)
from amp_compiler.onnx.report import OnnxConversionReport, count_casts, decision_rows
from amp_compiler.passes.painting.calibrate_ranges import check_calibration_data
from amp_compiler.passes.onnx.infer_types import infers_float_values
from amp_compiler.passes.onnx.lower_fp8_matmuls import fp8_opset
from amp_compiler.passes.pipelines import ONNX_PIPELINE, OnnxState
from amp_compiler.passes.runner import count



# ONNX files at the fp8 level run their other low ops in float16 (the default) or bfloat16; torch's fp8 level
# takes bfloat16 only. ONNX Runtime's CPU provider has no bfloat16 MatMul, Add or QuantizeLinear kernel
# (onnxruntime 1.31), while its float16 ones and QuantizeLinear/DequantizeLinear between float8 and float16
# run: a float16 file is one that can be checked here, and what TensorRT's fp8 GEMMs also take.
ONNX_FP8_LOW_DTYPES = (torch.float16, torch.bfloat16)


def onnx_config(entry: str, level: str, **options) -> AmpConfig:
    """make_config for the ONNX entry point `entry` (at the fp8 level float16 is allowed around the fp8 matmuls)."""
    config = make_config(level, fp8_low_dtypes=ONNX_FP8_LOW_DTYPES, **options)
    if config.fp8 is not None and config.fp8.scaling != "current":   # no amax history / row-wise scales in a file
        raise ValueError(f"{entry}: fp8_scaling={config.fp8.scaling!r} has no ONNX form: an ONNX fp8 model scales "
                         "per tensor, computed in the graph ('current'), or static from convert_onnx's calibration_data")
    return config


def convert_onnx(src, dst=None, level: str = "O1", *, keep_io_types: bool = True, op_block_list=None,
                 node_block_list=None, dtype=torch.float16, progress: bool | None = None,
                 calibration_data=None, **overrides) -> OnnxConversionReport:
    """Convert the fp32 ONNX model `src` (a path, an onnx.ModelProto or an onnx_ir.Model) and write the
    mixed-precision model to `dst`; with dst=None nothing is written and `report.model` holds the result
    (an onnx_ir.Model, converted in place, when src is one; else an onnx.ModelProto; src's proto is not
    changed). A model with nothing to convert (no float tensor, even after type inference) comes out
    unchanged, with a note in the report.

    op_block_list: ONNX op types kept fp32 ("Softmax"); node_block_list: node names kept fp32. Keyword
    overrides are convert()'s: allow_ops/deny_ops/... (canonical op names) and force_fp32/force_low
    (patterns on node names, or torch module paths when the file came from torch.onnx.export).
    progress: a progress bar on stderr (None: only for a conversion past PROGRESS_AFTER_SECONDS, on a terminal).
    calibration_data: samples (tuples of the graph's inputs); nodes whose fp32 values the low dtype cannot
    hold on them stay fp32 (passes/onnx/calibrate_ranges.py).
    """
    started = time.perf_counter()
    config = onnx_config("convert_onnx", level, dtype=dtype, keep_io_types=keep_io_types, **overrides)
    op_block_list, node_block_list = _names(op_block_list, "op_block_list"), _names(node_block_list, "node_block_list")
    check_calibration_data(calibration_data)
    if dst is not None:
        dst = check_writable(dst)   # before any work: a bad destination costs nothing
    model = load_onnx_model(src)
    report = OnnxConversionReport(_describe(src), "(returned)" if dst is None else dst, config.level,
                                  config.low_dtype_name, config.keep_io_types, casts_in_source=count_casts(model),
                                  weight_bytes_before=weight_bytes(model))
    with ConversionProgress(len(ONNX_PIPELINE.passes) + 1, enabled=progress) as steps:
        if not has_float_tensors(model) and not infers_float_values(model):
            report.notes.append("nothing to convert: no float32/float16/bfloat16 tensor, even after type "
                                "inference; the model is " + ("returned" if dst is None else "copied") + " unchanged")
            _write_unchanged(src, model, dst, report)
        else:
            report.pass_counts = run_onnx_pipeline(model, config, op_block_list=op_block_list,
                                                   node_block_list=node_block_list, on_pass=steps.advance,
                                                   calibration_data=calibration_data)
            _write(src, model, dst, report, steps)
    report.rows = decision_rows(model, config.low_dtype_name)
    report.casts, report.weight_bytes_after = count_casts(model), weight_bytes(model)
    report.warnings = conversion_warnings(report.pass_counts)
    report.seconds = time.perf_counter() - started
    return report


def _describe(src) -> str:
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    return f"(an {type(src).__module__.split('.')[0]}.{type(src).__name__})"


def _write(src, model: ir.Model, dst, report: OnnxConversionReport, steps) -> None:
    if dst is None:
        report.model = model if isinstance(src, ir.Model) else ir.to_proto(model)
        return
    steps.saving()
    save_onnx_model(model, dst, callback=steps.tensor_written)


def _write_unchanged(src, model: ir.Model, dst, report: OnnxConversionReport) -> None:
    if dst is None:
        report.model = src if isinstance(src, (ir.Model, onnx.ModelProto)) else ir.to_proto(model)
    elif isinstance(src, (str, os.PathLike)) and not has_external_tensors(model):
        copy_onnx_file(src, dst)   # byte for byte
    else:
        save_onnx_model(model, dst)


def run_onnx_pipeline(model: ir.Model, config: AmpConfig, *, op_block_list=(), node_block_list=(),
                      on_pass=None, calibration_data=None) -> dict:
    """Run ONNX_PIPELINE on `model` (in place); returns what each pass counted, by pass. on_pass(name) is
    called as each pass starts."""
    if not config.level_spec.paints:
        return {}
    if config.fp8 is not None:
        fp8_opset(model)   # FP8_OPSET (21): the version converter rewrites what changed before it
    state = OnnxState(model, config, tuple(op_block_list), tuple(node_block_list), calibration_data)
    return announcing(ONNX_PIPELINE, on_pass).run(state)


def conversion_warnings(counts: dict) -> list[str]:
    warnings = []
    overflowed, untyped = count(counts, "constant_values_overflowed"), count(counts, "values_typed_without_schema")
    if overflowed:
        warnings.append(f"{overflowed} constant values exceed the low-precision range "
                        "and became inf where the model itself casts them")
    if untyped:
        warnings.append(f"{untyped} values come from ops ONNX has no schema for; "
                        "their types are the rewrite's, not inferred")
    strict_failures = count(counts, "source_fails_strict_inference")
    if strict_failures:
        warnings.append(f"the input model itself fails ONNX's strict type inference at {strict_failures} node(s) "
                        "the conversion did not change; the rewrite was checked with non-strict inference")
    return warnings


def _names(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    items = tuple(value)
    if not all(isinstance(v, str) for v in items):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")
    return items
