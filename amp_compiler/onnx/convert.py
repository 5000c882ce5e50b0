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
from dataclasses import dataclass
from functools import cached_property

import onnx
import onnx_ir as ir
import torch
from onnx_ir.passes.common import TopologicalSortPass

from amp_compiler.config import AmpConfig, make_config
from amp_compiler.onnx.files import (check_writable, copy_onnx_file, has_external_tensors, has_float_tensors,
                                     load_onnx_model, save_onnx_model, weight_bytes)
from amp_compiler.onnx.progress import PROGRESS_AFTER_SECONDS, ConversionProgress, announcing  # noqa: F401 (old home)
from amp_compiler.onnx.report import OnnxConversionReport, count_casts, decision_rows
from amp_compiler.passes.onnx.calibrate_ranges import record_onnx_ranges
from amp_compiler.passes.onnx.coordinates import keep_onnx_coordinates_fp32
from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
from amp_compiler.passes.onnx.hand_written_norms import keep_onnx_hand_written_norms_fp32
from amp_compiler.passes.onnx.place_casts import OnnxCastPlacement
from amp_compiler.passes.painting.calibrate_ranges import calibrated_hooks, check_calibration_data
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.onnx.declare_initializer_inputs import declare_initializer_inputs
from amp_compiler.passes.onnx.fold_casts import fold_onnx_casts
from amp_compiler.passes.onnx.infer_types import infer_onnx_types, infers_float_values
from amp_compiler.passes.onnx.insert_casts import insert_onnx_casts
from amp_compiler.passes.onnx.lower_graph_inputs import lower_onnx_graph_inputs
from amp_compiler.passes.onnx.lower_fp8_matmuls import fp8_opset, lower_onnx_fp8_matmuls
from amp_compiler.passes.onnx.lower_movers_between_casts import lower_onnx_movers_between_casts
from amp_compiler.passes.onnx.canonicalize import all_nodes, onnx_canonicalize
from amp_compiler.passes.runner import Pass, PassResult, Pipeline, count
from amp_compiler.passes.onnx.store_moved_weights_low import store_moved_onnx_weights_low
from amp_compiler.passes.onnx.store_tied_weights_once import store_onnx_tied_weights_once
from amp_compiler.passes.onnx.strip_float_casts import strip_onnx_float_casts
from amp_compiler.passes.onnx.unify_input_types import unify_onnx_input_types
from amp_compiler.passes.onnx.unique_names import unique_onnx_names
from amp_compiler.passes.onnx.widen_denied_ops import widen_denied_onnx_ops
from amp_compiler.passes.onnx.widen_refused_nodes import widen_refused_onnx_nodes

IR_LOW_DTYPES = {torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}


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


@dataclass
class OnnxState:
    """What the ONNX passes share: the model (edited in place) and the conversion's choices."""
    model: ir.Model
    config: AmpConfig
    op_block_list: tuple[str, ...] = ()
    node_block_list: tuple[str, ...] = ()
    calibration_data: object = None
    exported: bool = False   # export_onnx: torch.onnx wrote the graph, its types and Casts, from convert()'s decisions
    low_families: frozenset[str] = frozenset()   # export_onnx: op families convert() painted low somewhere

    @property
    def low(self) -> ir.DataType:
        return IR_LOW_DTYPES[self.config.low_dtype]

    @cached_property
    def rules(self) -> PrecisionRules:
        return self.config.precision_rules()


def _decide(state: OnnxState) -> PassResult:
    coordinates = keep_onnx_coordinates_fp32(state.model.graph)   # positions from Range stay fp32
    norms = keep_onnx_hand_written_norms_fp32(state.model.graph, state.rules.norm_kept_fp32())   # as on fx
    hooks = (norms, coordinates, *calibrated_hooks(state.model.graph, state.config.low_dtype))
    placement = OnnxCastPlacement(state.model, state.config.keep_io_types, state.config.placement_method) \
        if state.config.cast_placement else None
    result = decide_onnx_precision(state.model, state.rules, state.low,
                                   op_block_list=state.op_block_list, node_block_list=state.node_block_list,
                                   painted=(*hooks, placement) if placement else hooks)
    if placement is not None:
        result.counts.update(placement.counts)
    return result


def sort_nodes(model: ir.Model) -> PassResult:
    return PassResult(modified=TopologicalSortPass()(model).modified)


def check_onnx_model(state) -> None:
    """The invariants every ONNX pass keeps: a model onnx.checker accepts (types are checked at the end)."""
    onnx.checker.check_model(ir.serde.serialize_model(state.model))


# How both entry points finish, once every precision is decided and every Cast is in the graph: export_onnx
# after torch.onnx wrote convert()'s decisions, convert_onnx after insert_casts. Passes for one side say why.
_EXPORTED = "on export_onnx"
# What the nodes may carry when the finishing passes start: convert_onnx's decisions (export_onnx's nodes, written by
# torch.onnx, carry none: the decisions are in their types and Casts, and reading a fact a node lacks reads nothing).
_DECIDED = ("op", "module", "class", "family", "reason", "precision", "rule", "forced", "range")
_EXPORTED_PAINTED = "on export_onnx at a level that paints (levels.py; not O0)"
ONNX_FINISH_PIPELINE = Pipeline("onnx finish", (
    Pass("unify_input_types", lambda s: unify_onnx_input_types(s.model),   # torch's fp16-data/fp32-weight norms
         when=lambda s: s.exported, when_says=_EXPORTED),                    # (insert_casts makes types agree)
    Pass("widen_refused_nodes", lambda s: widen_refused_onnx_nodes(s.model),   # fp16 kernels ONNX Runtime refuses
         when=lambda s: s.exported, when_says=_EXPORTED),                        # (convert_onnx paints them fp32)
    Pass("widen_denied_ops", lambda s: widen_denied_onnx_ops(s.model, s.rules, s.low_families),   # sdpa's Softmax
         when=lambda s: s.exported and s.config.level_spec.paints, when_says=_EXPORTED_PAINTED),   # (decide did)
    Pass("store_moved_weights_low", lambda s: store_moved_onnx_weights_low(s.model, s.low, s.rules),   # tables
         when=lambda s: s.config.level_spec.paints, when_says="when the level paints (levels.py; not O0)",
         reads=("forced",), writes=("precision", "rule")),
    Pass("fold_casts", lambda s: fold_onnx_casts(s.model)),   # weights, constants, chains, duplicates
    Pass("lower_movers_between_casts", lambda s: lower_onnx_movers_between_casts(s.model)),   # rows cast up, then down
    Pass("store_tied_weights_once", lambda s: store_onnx_tied_weights_once(s.model)),   # weights in final dtypes
    Pass("lower_graph_inputs", lambda s: lower_onnx_graph_inputs(s.model, s.low),
         when=lambda s: not s.config.keep_io_types, when_says="when keep_io_types=False"),
    Pass("declare_initializer_inputs", lambda s: declare_initializer_inputs(s.model),   # IR 3 wants them
         when=lambda s: s.model.ir_version < 4, when_says="when the model's IR version is below 4"),
    Pass("infer_types:verify", lambda s: infer_onnx_types(s.model, verify_rewrite=True),   # ONNX must agree
         when=lambda s: not s.exported, when_says="on convert_onnx (it checks its own rewrite's types)",
         reads=("precision",)),
    Pass("sort:after_rewrite", lambda s: sort_nodes(s.model)),
), check=check_onnx_model, nodes=lambda s: list(all_nodes(s.model.graph)), front_end_facts=_DECIDED)

ONNX_PIPELINE = Pipeline("onnx", (
    Pass("unique_names", lambda s: unique_onnx_names(s.model)),   # decisions and block lists address nodes by name
    Pass("sort", lambda s: sort_nodes(s.model)),
    Pass("canonicalize", lambda s: onnx_canonicalize(s.model), writes=("op", "module")),
    Pass("infer_types:fill", lambda s: infer_onnx_types(s.model, verify_rewrite=False)),   # what is float
    Pass("calibrate_ranges", lambda s: record_onnx_ranges(s.model, s.calibration_data, s.config.low_dtype),
         when=lambda s: s.calibration_data is not None, when_says="with calibration_data",   # fp32 runs on samples
         writes=("range",)),
    Pass("strip_float_casts", lambda s: strip_onnx_float_casts(s.model)),   # records source dtypes, painting decides
    Pass("decide_precision", lambda s: _decide(s),   # painting, calibration, then cast placement (as on fx)
         reads=("op", "module", "range"), writes=("class", "family", "reason", "precision", "rule", "forced")),
    Pass("insert_casts", lambda s: insert_onnx_casts(s.model, s.low, s.config.keep_io_types), reads=("precision",)),
    Pass("lower_fp8_matmuls", lambda s: lower_onnx_fp8_matmuls(s.model, s.config.fp8, s.low, exported=False),
         when=lambda s: s.config.fp8 is not None, when_says="at the fp8 level (levels.py)",   # the fx pass's twin
         reads=("precision", "module", "range"), writes=("rule",)),
    *ONNX_FINISH_PIPELINE.passes,
), check=check_onnx_model, nodes=ONNX_FINISH_PIPELINE.nodes)


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
