"""Every pipeline of the compiler, in one place. `amp-compiler pipelines` prints them all.

    convert(), compile() (each dynamo graph), export_onnx's graph   FX_PIPELINE
    convert_onnx (an fp32 ONNX file)                                 ONNX_PIPELINE   (ends with ONNX_FINISH_PIPELINE)
    export_onnx (torch.onnx wrote FX_PIPELINE's decisions)           EXPORT_PIPELINE (ends with ONNX_FINISH_PIPELINE)

Both IRs decide with the same painting (passes/painting/decide.py) and the same rules; decide_precision's lines
below list the hooks it composes, in the order they paint. One condition gates what a level that does not
paint (O0) skips: PAINTS. The ONNX pipelines are built on first use: importing onnx_ir takes 0.6 s that a
torch-only user should not pay (PEP 562 `__getattr__` below).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx

from amp_compiler.passes.fx.calibrate_ranges import record_ranges
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.cast_after_layout_ops import cast_after_layout_ops
from amp_compiler.passes.fx.constant_range import (constants_beyond_range, magnitude_carriers,
                                                   warn_constants_beyond_fp16)
from amp_compiler.passes.fx.coordinates import keep_fx_coordinates_fp32
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.explicit_upcasts import keep_fx_upcasts_fp32
from amp_compiler.passes.fx.fold_casts import fold_casts
from amp_compiler.passes.fx.fused_attention_masks import fused_attention_masks
from amp_compiler.passes.fx.hand_written_norms import keep_fx_hand_written_norms_fp32
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.insert_casts import insert_casts, output_value_nodes
from amp_compiler.passes.fx.lower_fp8_matmuls import lower_fp8_matmuls
from amp_compiler.passes.fx.lower_leaf_modules import lower_leaf_modules
from amp_compiler.passes.fx.measure_fp8_operands import measure_fp8_operands
from amp_compiler.passes.fx.opaque_calls import plan_opaque_calls
from amp_compiler.passes.fx.place_casts import FxCastPlacement
from amp_compiler.passes.fx.promote_in_kernel import promote_in_kernel
from amp_compiler.passes.fx.propagate_values import propagate_values
from amp_compiler.passes.fx.routing import keep_routing_fp32
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.calibrate_ranges import calibrated_hooks
from amp_compiler.passes.painting.keep_constants_fp32 import keep_constant_paths_fp32
from amp_compiler.passes.painting.keep_phases_fp32 import keep_phases_fp32
from amp_compiler.passes.runner import Condition, Pass, PassResult, Pipeline


class Hook(NamedTuple):
    """One painting hook decide_precision composes: its name (printed) and how it is made from the state."""
    name: str
    make: Callable[[Any, Any], tuple]   # (state, rules) -> the hooks (none, one, or several)


def _composed(hooks: tuple[Hook, ...], state, rules) -> tuple:
    return tuple(hook for entry in hooks for hook in entry.make(state, rules))


PAINTS = Condition(lambda s: s.config.level_spec.paints, "when the level paints (levels.py; not O0)")
FP8 = Condition(lambda s: s.config.fp8 is not None, "at the fp8 level (levels.py)")
CALIBRATED = Condition(lambda s: s.calibration_data is not None, "with calibration_data")


# -- fx -------------------------------------------------------------------------------------------------
@dataclass
class FxState:
    """What the fx passes share: the graph, the conversion's choices, and what the first dtype pass recorded."""
    gm: fx.GraphModule
    config: Any   # AmpConfig (amp_compiler/config.py)
    example_inputs: tuple | None = None
    original_outputs: list = field(default_factory=list)   # dtypes the original model returns
    calibration_data: object = None                          # iterable of input tuples, or None

    @property
    def low(self) -> torch.dtype:
        return self.config.low_dtype


FX_PAINTING_HOOKS = (   # in the order they paint; cast placement last (after calibration, around what it allows)
    Hook("keep_upcasts_fp32", lambda s, rules: (keep_fx_upcasts_fp32(s.gm),)),   # the model's own .to(float32)
    Hook("keep_hand_written_norms_fp32",   # pow -> mean -> rsqrt: a norm
         lambda s, rules: (keep_fx_hand_written_norms_fp32(s.gm, rules.norm_kept_fp32()),)),
    Hook("keep_constant_paths_fp32", lambda s, rules: (keep_constant_paths_fp32(   # -3.4e38 fills
        constants_beyond_range(s.gm, s.low), magnitude_carriers(s.gm, s.low), rules.low_dtype),)),
    Hook("keep_coordinates_fp32", lambda s, rules: (keep_fx_coordinates_fp32(s.gm),)),   # positions from arange
    Hook("keep_phases_fp32", lambda s, rules: (keep_phases_fp32(   # sin/cos arguments
        {n.name: facts(n).get("op") for n in s.gm.graph.nodes}.get),)),
    Hook("keep_routing_fp32", lambda s, rules: (keep_routing_fp32(s.gm),)),   # MoE top-k scores, scatter-add
    Hook("keep_out_of_range_fp32 (calibrated)", lambda s, rules: calibrated_hooks(s.gm.graph.nodes, s.low)),
    Hook("place_casts (cast_placement)", lambda s, rules: (
        FxCastPlacement(s.gm, rules, s.config.keep_io_types, s.config.placement_method),)
        if s.config.cast_placement else ()),
)


def _fx_original_dtypes(state: FxState) -> PassResult:
    result = infer_dtypes(state.gm, state.example_inputs, state.low)   # what is float, what we return
    state.original_outputs = [facts(n)["dtype"] for n in output_value_nodes(state.gm)]
    return result


def _fx_mark_unchanged(state: FxState) -> PassResult:
    for node in state.gm.graph.nodes:
        facts(node).update({"class": "-", "family": "-", "precision": None, "rule": f"{state.config.level}: unchanged"})
    return PassResult(modified=False)


def _fx_decide(state: FxState) -> PassResult:
    rules = state.config.precision_rules()
    painted = _composed(FX_PAINTING_HOOKS, state, rules)
    result = decide_fx_precision(state.gm, rules, painted=painted)
    for hook in painted:   # cast placement counts what it moved
        result.counts.update(getattr(hook, "counts", {}))
    return result


def check_fx_graph(state: FxState) -> None:
    """The invariant every fx pass keeps (passes/README.md): a valid, topologically ordered graph."""
    state.gm.graph.lint()


_DECISION = ("class", "family", "reason", "module", "precision", "rule", "fp32_weights")   # painting/decide.py
FX_PIPELINE = Pipeline("fx", (
    Pass("canonicalize", lambda s: canonicalize(s.gm), writes=("op", "inplace")),
    Pass("propagate_values", lambda s: propagate_values(s.gm, s.example_inputs),   # fake values
         when=Condition(lambda s: s.example_inputs is not None and not any("val" in n.meta for n in s.gm.graph.nodes),
                        "when the front end recorded no values"), reads=("op",)),
    Pass("infer_dtypes:original", _fx_original_dtypes, reads=("op",), writes=("dtype", "original_dtype")),
    Pass("mark_unchanged", _fx_mark_unchanged, when=Condition(lambda s: not PAINTS(s), "when the level does not paint"),
         writes=("class", "family", "precision", "rule")),
    Pass("calibrate_ranges", lambda s: record_ranges(s.gm, s.calibration_data, s.low),   # fp32 runs on samples
         when=PAINTS & CALIBRATED, writes=("range",)),
    Pass("decide_precision", _fx_decide, when=PAINTS, reads=("op", "inplace", "dtype", "range"), writes=_DECISION,
         steps=tuple(hook.name for hook in FX_PAINTING_HOOKS)),
    Pass("warn_constants_beyond_fp16", lambda s: warn_constants_beyond_fp16(s.gm),   # -1e9 into a float16 op
         when=PAINTS & Condition(lambda s: s.low == torch.float16, "in float16"),
         reads=("family", "precision", "class"), writes=("warning",)),
    Pass("plan_opaque_calls", lambda s: plan_opaque_calls(s.gm, s.low),   # bodies under autocast, outputs as before
         when=PAINTS, reads=("dtype",), writes=("rule",)),
    Pass("lower_leaf_modules", lambda s: lower_leaf_modules(s.gm, s.low),   # params via get_attr: castable
         when=PAINTS, reads=("hooks", "precision"), writes=("op", "class", "precision", "rule")),
    Pass("infer_dtypes:painted", lambda s: infer_dtypes(s.gm, s.example_inputs, s.low),   # what the painted graph computes
         when=PAINTS, reads=("op", "class", "family", "precision", "original_dtype"), writes=("dtype",)),
    Pass("insert_casts", lambda s: insert_casts(s.gm, s.low, s.original_outputs, s.config.keep_io_types),
         when=PAINTS, reads=("dtype", "precision", "family", "fp32_weights", "inplace", "module"),
         writes=("op", "class", "precision", "dtype", "module", "rule")),
    Pass("fold_casts", lambda s: fold_casts(s.gm), when=PAINTS,   # cleans up the inserts
         reads=("dtype", "inplace", "family")),
    Pass("cast_after_layout_ops", lambda s: cast_after_layout_ops(s.gm),   # a transposed low input slows matmuls
         when=PAINTS, reads=("op", "precision", "dtype"), writes=("op", "dtype", "precision", "rule")),
    Pass("promote_in_kernel", lambda s: promote_in_kernel(s.gm),   # bf16 + fp32 upcasts as it reads: no copy
         when=PAINTS, reads=("op", "inplace", "dtype", "rule"), writes=("rule",)),
    Pass("fused_attention_masks", lambda s: fused_attention_masks(s.gm),   # GPU sdpa kernels need mask stride 1
         when=PAINTS, reads=("op",), writes=("op", "class", "precision", "rule")),
    Pass("measure_fp8_operands", lambda s: measure_fp8_operands(s.gm, s.calibration_data, s.config.fp8.margin),
         when=FP8 & CALIBRATED, reads=("family", "precision"),   # an analysis: bf16 runs
         writes=("fp8_calibration",)),
    Pass("lower_fp8_matmuls", lambda s: lower_fp8_matmuls(s.gm, s.config.fp8, s.low),   # after every bf16 decision
         when=FP8, reads=("family", "precision", "module", "dtype", "op", "rule", "fp8_calibration"),
         writes=("rule", "op", "dtype")),   # op, dtype: on the scaling nodes it adds
), check=check_fx_graph, nodes=lambda s: list(s.gm.graph.nodes), front_end_facts=("hooks",))


def run_fx_pipeline(gm: fx.GraphModule, config, example_inputs=None, calibration_data=None) -> dict[str, dict]:
    """Run FX_PIPELINE on `gm` (in place); returns what each pass counted, by pass. The Python code is
    generated once, here: the passes edit gm.graph."""
    state = FxState(gm, config, example_inputs, calibration_data=calibration_data)
    counts = FX_PIPELINE.run(state)
    if PAINTS(state):
        gm.graph.lint()
    gm.recompile()
    return counts


# -- ONNX -----------------------------------------------------------------------------------------------
@dataclass
class OnnxState:
    """What the ONNX passes share: the model (an onnx_ir.Model, edited in place) and the conversion's choices."""
    model: Any
    config: Any   # AmpConfig
    op_block_list: tuple[str, ...] = ()
    node_block_list: tuple[str, ...] = ()
    calibration_data: object = None
    exported: bool = False   # export_onnx: torch.onnx wrote the graph, its types and Casts, from convert()'s decisions
    low_families: frozenset[str] = frozenset()   # export_onnx: op families convert() painted low somewhere

    @property
    def low(self):   # the low dtype as ONNX names it
        from amp_compiler.passes.onnx.spec import ir_low_dtype
        return ir_low_dtype(self.config.low_dtype_name)

    @cached_property
    def rules(self):
        return self.config.precision_rules()


EXPORTED = Condition(lambda s: s.exported, "on export_onnx")
# What the nodes may carry when the finishing passes start: convert_onnx's decisions (export_onnx's nodes, written by
# torch.onnx, carry none: the decisions are in their types and Casts, and reading a fact a node lacks reads nothing).
_ONNX_DECIDED = ("op", "module", "class", "family", "reason", "precision", "rule", "forced", "range")


@functools.cache
def _onnx_pipelines() -> dict[str, Pipeline]:
    import onnx
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass

    from amp_compiler.passes.onnx.calibrate_ranges import record_onnx_ranges
    from amp_compiler.passes.onnx.canonicalize import all_nodes, onnx_canonicalize
    from amp_compiler.passes.onnx.coordinates import keep_onnx_coordinates_fp32
    from amp_compiler.passes.onnx.decide_precision import decide_onnx_precision
    from amp_compiler.passes.onnx.declare_initializer_inputs import declare_initializer_inputs
    from amp_compiler.passes.onnx.fold_casts import fold_onnx_casts
    from amp_compiler.passes.onnx.hand_written_norms import keep_onnx_hand_written_norms_fp32
    from amp_compiler.passes.onnx.infer_types import infer_onnx_types
    from amp_compiler.passes.onnx.insert_casts import insert_onnx_casts
    from amp_compiler.passes.onnx.lower_fp8_matmuls import lower_onnx_fp8_matmuls
    from amp_compiler.passes.onnx.lower_graph_inputs import lower_onnx_graph_inputs
    from amp_compiler.passes.onnx.lower_movers_between_casts import lower_onnx_movers_between_casts
    from amp_compiler.passes.onnx.place_casts import OnnxCastPlacement
    from amp_compiler.passes.onnx.store_moved_weights_low import store_moved_onnx_weights_low
    from amp_compiler.passes.onnx.store_tied_weights_once import store_onnx_tied_weights_once
    from amp_compiler.passes.onnx.strip_float_casts import strip_onnx_float_casts
    from amp_compiler.passes.onnx.unify_input_types import unify_onnx_input_types
    from amp_compiler.passes.onnx.unique_names import unique_onnx_names
    from amp_compiler.passes.onnx.widen_denied_ops import widen_denied_onnx_ops
    from amp_compiler.passes.onnx.widen_refused_nodes import widen_refused_onnx_nodes

    painting_hooks = (   # as on fx, those that have an ONNX form
        Hook("keep_hand_written_norms_fp32",
             lambda s, rules: (keep_onnx_hand_written_norms_fp32(s.model.graph, rules.norm_kept_fp32()),)),
        Hook("keep_coordinates_fp32", lambda s, rules: (keep_onnx_coordinates_fp32(s.model.graph),)),  # from Range
        Hook("keep_out_of_range_fp32 (calibrated)",
             lambda s, rules: calibrated_hooks(s.model.graph, s.config.low_dtype)),
        Hook("place_casts (cast_placement)", lambda s, rules: (
            OnnxCastPlacement(s.model, s.config.keep_io_types, s.config.placement_method),)
            if s.config.cast_placement else ()),
    )

    def decide(state: OnnxState) -> PassResult:
        painted = _composed(painting_hooks, state, state.rules)
        result = decide_onnx_precision(state.model, state.rules, state.low, op_block_list=state.op_block_list,
                                       node_block_list=state.node_block_list, painted=painted)
        for hook in painted:
            result.counts.update(getattr(hook, "counts", {}))
        return result

    def sort_nodes(model) -> PassResult:
        return PassResult(modified=TopologicalSortPass()(model).modified)

    def check_onnx_model(state) -> None:   # the invariant every ONNX pass keeps (types are checked at the end)
        onnx.checker.check_model(ir.serde.serialize_model(state.model))

    # How both ONNX entry points finish, once every precision is decided and every Cast is in the graph
    finish = Pipeline("onnx finish", (
        Pass("unify_input_types", lambda s: unify_onnx_input_types(s.model),   # torch's fp16-data/fp32-weight norms
             when=EXPORTED),                                                     # (insert_casts makes types agree)
        Pass("widen_refused_nodes", lambda s: widen_refused_onnx_nodes(s.model),   # fp16 kernels ONNX Runtime refuses
             when=EXPORTED),                                                         # (convert_onnx paints them fp32)
        Pass("widen_denied_ops", lambda s: widen_denied_onnx_ops(s.model, s.rules, s.low_families),   # sdpa's Softmax
             when=EXPORTED & PAINTS),                                                                  # (decide did)
        Pass("store_moved_weights_low", lambda s: store_moved_onnx_weights_low(s.model, s.low, s.rules),   # tables
             when=PAINTS, reads=("forced",), writes=("precision", "rule")),
        Pass("fold_casts", lambda s: fold_onnx_casts(s.model)),   # weights, constants, chains, duplicates
        Pass("lower_movers_between_casts", lambda s: lower_onnx_movers_between_casts(s.model)),   # rows cast up, down
        Pass("store_tied_weights_once", lambda s: store_onnx_tied_weights_once(s.model)),   # weights in final dtypes
        Pass("lower_graph_inputs", lambda s: lower_onnx_graph_inputs(s.model, s.low),
             when=Condition(lambda s: not s.config.keep_io_types, "when keep_io_types=False")),
        Pass("declare_initializer_inputs", lambda s: declare_initializer_inputs(s.model),   # IR 3 wants them
             when=Condition(lambda s: s.model.ir_version < 4, "when the model's IR version is below 4")),
        Pass("infer_types:verify", lambda s: infer_onnx_types(s.model, verify_rewrite=True),   # ONNX must agree
             when=Condition(lambda s: not s.exported, "on convert_onnx (it checks its own rewrite's types)"),
             reads=("precision",)),
        Pass("sort:after_rewrite", lambda s: sort_nodes(s.model)),
    ), check=check_onnx_model, nodes=lambda s: list(all_nodes(s.model.graph)), front_end_facts=_ONNX_DECIDED)

    convert = Pipeline("onnx", (
        Pass("unique_names", lambda s: unique_onnx_names(s.model)),   # decisions and block lists address nodes by name
        Pass("sort", lambda s: sort_nodes(s.model)),
        Pass("canonicalize", lambda s: onnx_canonicalize(s.model), writes=("op", "module")),
        Pass("infer_types:fill", lambda s: infer_onnx_types(s.model, verify_rewrite=False)),   # what is float
        Pass("calibrate_ranges", lambda s: record_onnx_ranges(s.model, s.calibration_data, s.config.low_dtype),
             when=CALIBRATED, writes=("range",)),   # fp32 runs on samples
        Pass("strip_float_casts", lambda s: strip_onnx_float_casts(s.model),   # painting decides every boundary
             graph_writes=("value meta source_input_dtypes", "graph meta source_output_dtypes")),
        Pass("decide_precision", decide, reads=("op", "module", "range"),
             writes=("class", "family", "reason", "precision", "rule", "forced"),
             steps=tuple(hook.name for hook in painting_hooks)),
        Pass("insert_casts", lambda s: insert_onnx_casts(s.model, s.low, s.config.keep_io_types), reads=("precision",)),
        Pass("lower_fp8_matmuls", lambda s: lower_onnx_fp8_matmuls(s.model, s.config.fp8, s.low, exported=False),
             when=FP8, reads=("precision", "module", "range"), writes=("rule",)),   # the fx pass's twin
        *finish.passes,
    ), check=check_onnx_model, nodes=finish.nodes)

    export = Pipeline("export_onnx", (
        Pass("unique_names", lambda s: unique_onnx_names(s.model)),
        Pass("lower_fp8_matmuls", lambda s: lower_onnx_fp8_matmuls(s.model, s.config.fp8, s.low, exported=True),
             when=FP8),   # the fp8 matmuls convert() decided
        *finish.passes,   # with the passes only an export needs (when=EXPORTED)
    ), check=check_onnx_model, nodes=finish.nodes, front_end_facts=("forced",))   # none carried
    return {"ONNX_FINISH_PIPELINE": finish, "ONNX_PIPELINE": convert, "EXPORT_PIPELINE": export,
            "check_onnx_model": check_onnx_model, "sort_nodes": sort_nodes}


def __getattr__(name: str):
    if name in ("ONNX_FINISH_PIPELINE", "ONNX_PIPELINE", "EXPORT_PIPELINE", "check_onnx_model", "sort_nodes"):
        return _onnx_pipelines()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pipelines() -> list[Pipeline]:
    """Every pipeline, in the order of the module docstring (the ONNX ones share their finishing passes)."""
    built = _onnx_pipelines()
    return [FX_PIPELINE, built["ONNX_PIPELINE"], built["EXPORT_PIPELINE"]]


def describe(facts_tables: bool = False) -> str:
    """Every pipeline printed whole, decide's hooks under it; with facts_tables, what each pass reads and writes."""
    return "\n\n".join(p.facts_table() if facts_tables else str(p) for p in pipelines())


def with_listings_updated(markdown: str) -> str:
    """`markdown` with every fenced block that starts "<name> pipeline:" replaced by that pipeline as it prints
    now: the docs' listings are generated (`amp-compiler pipelines --update passes/README.md`); a test fails on a
    stale one."""
    printed = {p.name: str(p) for p in pipelines()}
    blocks = markdown.split("```")
    for i in range(1, len(blocks), 2):   # the odd pieces are inside fences
        name = blocks[i].lstrip("\n").split(" pipeline:", 1)[0]
        if blocks[i].lstrip("\n").startswith(f"{name} pipeline:") and name in printed:
            blocks[i] = f"\n{printed[name]}\n"
    return "```".join(blocks)
