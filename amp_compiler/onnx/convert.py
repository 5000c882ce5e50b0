"""convert_onnx(): an existing fp32 ONNX file to mixed precision, with the rules convert() uses for training.

    load -> unique names -> sort -> canonicalize -> type the source -> strip float casts -> decide
         -> store moved weights low -> insert casts -> fold casts -> (lower graph inputs) -> re-infer types
         -> sort -> save

The same policy table (passes/policy/op_policy.py), the same PrecisionRules and the same paint_precision decide;
only the view builder and the rewrite are ONNX-specific.
"""
from __future__ import annotations

import os
import time

import onnx_ir as ir
import torch
from onnx_ir.passes.common import TopologicalSortPass

from amp_compiler.config import AmpConfig, make_config
from amp_compiler.onnx.files import load_onnx_model, require_float_tensors, save_onnx_model, weight_bytes
from amp_compiler.onnx.report import OnnxConversionReport, count_casts, decision_rows
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.fold_casts import fold_onnx_casts
from amp_compiler.passes.onnx.infer_types import infer_onnx_types
from amp_compiler.passes.onnx.insert_casts import insert_onnx_casts
from amp_compiler.passes.onnx.lower_graph_inputs import lower_onnx_graph_inputs
from amp_compiler.passes.onnx.canonicalize import onnx_canonicalize
from amp_compiler.passes.pass_result import PassResult
from amp_compiler.passes.onnx.store_moved_weights_low import store_moved_onnx_weights_low
from amp_compiler.passes.onnx.strip_float_casts import strip_onnx_float_casts
from amp_compiler.passes.onnx.unique_names import unique_onnx_names

IR_LOW_DTYPES = {torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}


def convert_onnx(src, dst, level: str = "O1", *, keep_io_types: bool = True, op_block_list=None,
                 node_block_list=None, dtype=torch.float16, **overrides) -> OnnxConversionReport:
    """Convert the fp32 ONNX model at `src` and write the mixed-precision model to `dst`.

    op_block_list: ONNX op types kept fp32 ("Softmax"); node_block_list: node names kept fp32. Keyword
    overrides are convert()'s: allow_ops/deny_ops/... (canonical op names) and force_fp32/force_low
    (patterns on node names, or torch module paths when the file came from torch.onnx.export).
    """
    started = time.perf_counter()
    config = make_config(level, dtype=dtype, keep_io_types=keep_io_types, **overrides)
    model = load_onnx_model(src)
    require_float_tensors(model, src)
    report = OnnxConversionReport(os.fspath(src), os.fspath(dst), config.level, config.low_dtype_name,
                                  config.keep_io_types, casts_in_source=count_casts(model),
                                  weight_bytes_before=weight_bytes(model))
    report.pass_counts = run_onnx_pipeline(model, config, op_block_list=_names(op_block_list, "op_block_list"),
                                           node_block_list=_names(node_block_list, "node_block_list"))
    save_onnx_model(model, dst)
    report.rows = decision_rows(model, config.low_dtype_name)
    report.casts, report.weight_bytes_after = count_casts(model), weight_bytes(model)
    report.warnings = conversion_warnings(report.pass_counts)
    report.seconds = time.perf_counter() - started
    return report


def run_onnx_pipeline(model: ir.Model, config: AmpConfig, *, op_block_list=(), node_block_list=()) -> dict:
    """Run the ONNX passes in order on `model` (in place); returns what each pass counted."""
    low = IR_LOW_DTYPES[config.low_dtype]
    if config.level == "O0":
        return {}
    steps = (
        lambda: unique_onnx_names(model),             # decisions and block lists address nodes by name
        lambda: _sorted(model),
        lambda: onnx_canonicalize(model),
        lambda: infer_onnx_types(model, verify_rewrite=False),   # painting needs to know what is float
        lambda: strip_onnx_float_casts(model),        # records source dtypes, then lets painting decide
        lambda: decide_onnx_precision(model, config.precision_rules(), low, op_block_list=op_block_list,
                                      node_block_list=node_block_list),
        lambda: store_moved_onnx_weights_low(model, low),   # after painting: it revisits fp32 data movement
        lambda: insert_onnx_casts(model, low, config.keep_io_types),
        lambda: fold_onnx_casts(model),               # after insertion: weights, constants, chains, duplicates
        lambda: lower_onnx_graph_inputs(model, low) if not config.keep_io_types else PassResult(model, False),
        lambda: infer_onnx_types(model, verify_rewrite=True),   # last rewrite done: ONNX must agree
        lambda: _sorted(model),
    )
    counts: dict[str, int] = {}
    for step in steps:
        counts.update(step().counts)
    return counts


def conversion_warnings(counts: dict) -> list[str]:
    warnings = []
    if counts.get("constant_values_overflowed"):
        warnings.append(f"{counts['constant_values_overflowed']} constant values exceed the low-precision range "
                        "and became inf where the model itself casts them")
    if counts.get("values_typed_without_schema"):
        warnings.append(f"{counts['values_typed_without_schema']} values come from ops ONNX has no schema for; "
                        "their types are the rewrite's, not inferred")
    return warnings


def _sorted(model: ir.Model) -> PassResult:
    result = TopologicalSortPass()(model)
    return PassResult(model, modified=result.modified)


def _names(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    items = tuple(value)
    if not all(isinstance(v, str) for v in items):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")
    return items
