"""convert(): the whole compiler as one readable pipeline, FX_PIPELINE (print it to see the passes).

    convert(model) = compile_graph(capture(model), config)
    capture (frontend/capture.py: the only place a model is traced; seconds on an LLM)
      -> compile_graph: a copy of the captured graph -> FX_PIPELINE (canonicalize ... decide_precision ...
         insert_casts -> fold_casts -> ...; tens of milliseconds) -> GraphModule (+ gm.meta["amp"] summary)
One capture can be compiled many times (export_onnx compiles it again with force_fp32). A model whose own
forward cannot be captured runs as written with its children converted (convert_children).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.config import AmpConfig, make_config, with_model_lists
from amp_compiler.convert_children import convert_children
from amp_compiler.frozen import freeze as freeze_weights
from amp_compiler.frontend import CapturedGraph, TracingError, capture, graph_module_to_compile
from amp_compiler.frontend.hooks import hook_fates, user_hooks_silenced
from amp_compiler.frontend.training_reads import READS, follow_training_flags
from amp_compiler.passes.fx.calibrate_ranges import record_ranges
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.constant_range import (constants_beyond_range, magnitude_carriers,
                                                   warn_constants_beyond_fp16)
from amp_compiler.passes.fx.cast_after_layout_ops import cast_after_layout_ops
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.coordinates import keep_fx_coordinates_fp32
from amp_compiler.passes.fx.explicit_upcasts import keep_fx_upcasts_fp32
from amp_compiler.passes.fx.hand_written_norms import keep_fx_hand_written_norms_fp32
from amp_compiler.passes.fx.fold_casts import count_casts, fold_casts
from amp_compiler.passes.fx.fused_attention_masks import fused_attention_masks
from amp_compiler.passes.fx.promote_in_kernel import promote_in_kernel
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.insert_casts import insert_casts, output_value_nodes
from amp_compiler.passes.fx.lower_fp8_matmuls import lower_fp8_matmuls
from amp_compiler.passes.fx.lower_leaf_modules import lower_leaf_modules
from amp_compiler.passes.fx.measure_fp8_operands import measure_fp8_operands
from amp_compiler.passes.fx.opaque_calls import plan_opaque_calls
from amp_compiler.passes.fx.place_casts import FxCastPlacement
from amp_compiler.passes.fx.propagate_values import propagate_values
from amp_compiler.passes.fx.routing import keep_routing_fp32
from amp_compiler.passes.painting.calibrate_ranges import calibrated_hooks, check_calibration_data
from amp_compiler.passes.painting.keep_constants_fp32 import keep_constant_paths_fp32
from amp_compiler.passes.painting.keep_phases_fp32 import keep_phases_fp32
from amp_compiler.passes.runner import Pass, PassResult, Pipeline
from amp_compiler.saved_decisions import preserve_decisions
from amp_compiler.target_devices import target_devices
from amp_compiler.passes.node_facts import facts


def convert(model: nn.Module, level: str = "O1", *, example_inputs: tuple | None = None,
            dynamic_shapes=None, calibration_data=None, freeze: bool = False, inplace: bool = False,
            capture: str | None = None, **overrides) -> fx.GraphModule:
    """Trace `model` and return a GraphModule whose every node runs in the precision the rules pick.

    The result shares the model's parameters and buffers (an optimizer on model.parameters() trains it)
    and never changes the model. `amp_compiler.explain(gm)` tells why each node got its dtype.
    `dynamic_shapes` (torch.export's format) is used when the model needs the torch.export front end;
    by default every dim torch.export can keep dynamic stays dynamic. `calibration_data`: an iterable of
    input tuples; the fp32 model runs on each and nodes whose values the low dtype cannot hold stay fp32.
    `freeze=True`: inference calls read low-precision weight copies made once (amp_compiler.freeze).
    `inplace=True`: the model itself is converted and returned (same class, methods, forward signature and
    state_dict); it is captured on its first calls, example_inputs optional.
    In place, TorchDynamo captures the model's calls and the same passes convert each graph
    (amp_compiler.compile(model, level, backend="eager"): generate() with attention low, checkpointing
    recomputed, calibration on the graphs' own inputs, a weight-cast cache in inference, on by default:
    freeze=True changes nothing there, weight_cache=False turns it off; see amp_compiler/dynamo/). A model
    sharded with FSDP2 per block is compiled per block on its first sharded call. `capture="dynamo"` names that
    capture (the only one: the parts capture of 0.1 was retired, see CHANGELOG.md).
    """
    if capture is not None and capture not in CAPTURES:
        retired = " (the parts capture was retired: in-place conversion runs on TorchDynamo, which takes every " \
                  "request it took)" if capture == "parts" else ""
        raise ValueError(f"capture must be {', '.join(map(repr, CAPTURES))}; got {capture!r}{retired}")
    weight_cache = overrides.pop("weight_cache", None)
    config = make_config(level, **overrides)
    check_calibration_data(calibration_data)   # before any work: a bare tensor would be split into rows
    if capture is not None and not inplace:
        raise ValueError(f"capture={capture!r} applies to inplace=True (convert() without it returns a GraphModule "
                         "from fx or torch.export)")
    if inplace and dynamic_shapes is not None:
        raise ValueError("dynamic_shapes does not apply to inplace=True: the model is captured on the calls it gets, "
                         "and captured shape-generic again when a call's shapes need it")
    if weight_cache is not None and not inplace:
        raise ValueError("weight_cache applies to inplace=True (whose weight cache is on by default); without it "
                         "freeze=True keeps low weight copies")
    if inplace and freeze and weight_cache is False:
        raise ValueError("freeze=True keeps low weight copies and weight_cache=False keeps none: in place the weight "
                         "cache is the freeze (on by default); pass one of them")
    if inplace:
        return _convert_on_dynamo(model, config, level, example_inputs, calibration_data, overrides,
                                  weight_cache=True if weight_cache is None else weight_cache)
    with collector_paused():
        return _convert(model, config, level, example_inputs, dynamic_shapes, calibration_data, freeze, overrides)


CAPTURES = ("dynamo",)   # in place: TorchDynamo's


def _convert_on_dynamo(model, config, level, example_inputs, calibration_data, overrides, *,
                       weight_cache: bool = True) -> nn.Module:
    from amp_compiler.dynamo.compile import compile as compile_on_dynamo   # it imports this module
    from amp_compiler.dynamo.in_place import capture_now, refuse_in_place_request
    refuse_in_place_request(model, example_inputs)
    compile_on_dynamo(model, level, backend="eager", weight_cache=weight_cache, calibration_data=calibration_data,
                      **overrides)
    capture_now(model, example_inputs)
    return model


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused while converting: a conversion allocates some 10^5 graph objects,
    and each full collection they trigger walks every live object (the model's, a large graph's) again: a
    tenth of a second to seconds on an LLM. The garbage is collected as usual afterwards."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _convert(model, config, level, example_inputs, dynamic_shapes, calibration_data, freeze, overrides):
    try:
        captured = capture(model, example_inputs, dynamic_shapes)
    except TracingError as error:
        return convert_uncapturable(model, error, level, example_inputs, dynamic_shapes, calibration_data,
                                    freeze, overrides)
    # convert_again(copy, example_inputs=...): a mode that cannot be captured converts its children with a call's inputs
    return compile_graph(captured, config, calibration_data, freeze=freeze, convert_again=lambda copy, **given: convert(
        copy, level, example_inputs=given.get("example_inputs", example_inputs), dynamic_shapes=dynamic_shapes,
        calibration_data=calibration_data, freeze=freeze, **overrides), spend_capture=True)


def convert_uncapturable(model: nn.Module, error: TracingError, level: str, example_inputs, dynamic_shapes,
                         calibration_data, freeze: bool, overrides: dict) -> nn.Module:
    """The model as written with its children converted (convert_children), every option forwarded; else
    re-raises `error` (the model has no children or there are no example inputs to record theirs)."""
    if example_inputs is None or not any(True for _ in model.children()):
        raise error
    converted = convert_children(model, error, convert, level, example_inputs, calibration_data=calibration_data,
                                 dynamic_shapes=dynamic_shapes, **overrides)
    return freeze_weights(converted) if freeze else converted


def compile_graph(captured: CapturedGraph, config: AmpConfig, calibration_data=None, *, freeze: bool = False,
                  convert_again: Callable[[nn.Module], fx.GraphModule] | None = None,
                  follow_flags: bool = True, spend_capture: bool = False) -> fx.GraphModule:
    """FX_PIPELINE on a copy of `captured`'s graph (the capture is left as it was: compile it again with
    another config). `convert_again(model_copy)` converts the model in other train()/eval() flags when the
    graph read `self.training` (default: capture that copy and compile it with this config); follow_flags=False:
    the caller does that itself (dynamo guards on the user's modules' flags).
    spend_capture=True (convert(): one compilation per capture): the passes edit the capture's own graph, no copy."""
    model, example_inputs = captured.model, captured.example_inputs
    config = with_model_lists(config, model)   # a copy: target devices are written on it below; _keep_in_fp32_modules
    gm = graph_module_to_compile(captured, generate_code=False, spend=spend_capture)   # run_pipeline: the code, once
    config.devices, devices_from = target_devices(model, example_inputs)   # ops they have no low kernel for stay fp32
    with user_hooks_silenced(gm):   # the user's hooks fire on calls, not on fake values or calibration runs
        counts = run_pipeline(gm, config, example_inputs, calibration_data)
    gm.meta["amp"] = {
        "level": config.level, "requested_level": config.requested_level,
        "dtype": config.low_dtype_name, "frontend": captured.frontend, "leaf_modules": list(captured.leaves),
        "notes": list(captured.notes), "opaque": dict(captured.opaque), "keep_io_types": config.keep_io_types,
        "casts": count_casts(gm), "pass_counts": counts, "loss_scale_manager": config.loss_scale_manager,
        "devices": {"devices": list(config.devices), "from": devices_from},
        "hooks": hook_fates(gm, captured.hooked, captured.frontend), "training_reads": dict(captured.training_reads),
    }
    preserve_decisions(gm)   # explain/render/compare keep working after torch.save / torch.load
    if captured.training_reads and follow_flags:   # `if self.training:` was decided at capture: a call in another mode captures again
        gm.__dict__[READS] = dict(captured.training_reads)
        follow_training_flags(gm, model, convert_again or (lambda copy, **given: compile_graph(
            capture(copy, example_inputs, captured.dynamic_shapes), config, calibration_data, freeze=freeze)))
    return freeze_weights(gm) if freeze else gm


@dataclass
class FxState:
    """What the fx passes share: the graph, the conversion's choices, and what the first dtype pass recorded."""
    gm: fx.GraphModule
    config: AmpConfig
    example_inputs: tuple | None = None
    original_outputs: list = field(default_factory=list)   # dtypes the original model returns
    calibration_data: object = None                          # iterable of input tuples, or None

    @property
    def low(self) -> torch.dtype:
        return self.config.low_dtype

    @property
    def paints(self) -> bool:
        return self.config.level_spec.paints


def _original_dtypes(state: FxState) -> PassResult:
    result = infer_dtypes(state.gm, state.example_inputs, state.low)   # what is float, what we return
    state.original_outputs = [facts(n)["dtype"] for n in output_value_nodes(state.gm)]
    return result


def _mark_unchanged(state: FxState) -> PassResult:
    for node in state.gm.graph.nodes:
        facts(node).update({"class": "-", "family": "-", "precision": None, "rule": f"{state.config.level}: unchanged"})
    return PassResult(modified=False)


def _paints(state: FxState) -> bool:
    return state.paints


def _decide(state: FxState) -> PassResult:
    rules = state.config.precision_rules()
    constants = keep_constant_paths_fp32(constants_beyond_range(state.gm, state.low),   # -3.4e38 fills stay fp32
                                         magnitude_carriers(state.gm, state.low), rules.low_dtype)
    coordinates = keep_fx_coordinates_fp32(state.gm)   # positions from arange (RAFT's coords) stay fp32
    phases = keep_phases_fp32({n.name: facts(n).get("op") for n in state.gm.graph.nodes}.get)   # sin/cos arguments
    routing = keep_routing_fp32(state.gm)   # top-k scores and scatter-add buffers (MoE routing) stay fp32
    upcasts = keep_fx_upcasts_fp32(state.gm)   # the model's own .to(float32): what computes on it stays fp32
    norms = keep_fx_hand_written_norms_fp32(state.gm, rules.norm_kept_fp32())   # pow -> mean -> rsqrt: a norm
    hooks = (upcasts, norms, constants, coordinates, phases, routing,
             *calibrated_hooks(state.gm.graph.nodes, state.low))   # calibrated: the ranges decide too
    placement = FxCastPlacement(state.gm, rules, state.config.keep_io_types, state.config.placement_method) \
        if state.config.cast_placement else None
    result = decide_fx_precision(state.gm, rules, painted=(*hooks, placement) if placement else hooks)
    if placement is not None:   # after calibration: casts move around the precisions the ranges allow
        result.counts.update(placement.counts)
    return result


def check_fx_graph(state: FxState) -> None:
    """The invariant every fx pass keeps (passes/README.md): a valid, topologically ordered graph."""
    state.gm.graph.lint()


_PAINTING = "when the level paints (levels.py; not O0)"
_DECISION = ("class", "family", "reason", "module", "precision", "rule", "fp32_weights")   # painting/decide.py
FX_PIPELINE = Pipeline("fx", (
    Pass("canonicalize", lambda s: canonicalize(s.gm), writes=("op", "inplace")),
    Pass("propagate_values", lambda s: propagate_values(s.gm, s.example_inputs),   # fake values
         when=lambda s: s.example_inputs is not None and not any("val" in n.meta for n in s.gm.graph.nodes),
         when_says="when the front end recorded no values", reads=("op",)),
    Pass("infer_dtypes:original", _original_dtypes, reads=("op",), writes=("dtype", "original_dtype")),
    Pass("mark_unchanged", _mark_unchanged, when=lambda s: not s.paints, when_says="when the level does not paint",
         writes=("class", "family", "precision", "rule")),
    Pass("calibrate_ranges", lambda s: record_ranges(s.gm, s.calibration_data, s.low),   # fp32 runs on samples
         when=lambda s: s.paints and s.calibration_data is not None, when_says="with calibration_data, at a level that paints",
         writes=("range",)),
    Pass("decide_precision", _decide, when=_paints, when_says=_PAINTING,   # low/fp32 on floats
         reads=("op", "inplace", "dtype", "range"), writes=_DECISION),
    Pass("warn_constants_beyond_fp16", lambda s: warn_constants_beyond_fp16(s.gm),   # -1e9 into a float16 op
         when=lambda s: s.paints and s.low == torch.float16, when_says="when the level paints, in float16",
         reads=("family", "precision", "class"), writes=("warning",)),
    Pass("plan_opaque_calls", lambda s: plan_opaque_calls(s.gm, s.low),   # bodies under autocast, outputs as before
         when=_paints, when_says=_PAINTING, reads=("dtype",), writes=("rule",)),
    Pass("lower_leaf_modules", lambda s: lower_leaf_modules(s.gm, s.low),   # params via get_attr: castable
         when=_paints, when_says=_PAINTING, reads=("hooks", "precision"), writes=("op", "class", "precision", "rule")),
    Pass("infer_dtypes:painted", lambda s: infer_dtypes(s.gm, s.example_inputs, s.low),   # what the painted graph computes
         when=_paints, when_says=_PAINTING, reads=("op", "class", "family", "precision", "original_dtype"),
         writes=("dtype",)),
    Pass("insert_casts", lambda s: insert_casts(s.gm, s.low, s.original_outputs, s.config.keep_io_types),
         when=_paints, when_says=_PAINTING, reads=("dtype", "precision", "family", "fp32_weights", "inplace", "module"),
         writes=("op", "class", "precision", "dtype", "module", "rule")),
    Pass("fold_casts", lambda s: fold_casts(s.gm), when=_paints, when_says=_PAINTING,   # cleans up the inserts
         reads=("dtype", "inplace", "family")),
    Pass("cast_after_layout_ops", lambda s: cast_after_layout_ops(s.gm),   # a transposed low input slows matmuls
         when=_paints, when_says=_PAINTING, reads=("op", "precision", "dtype"),
         writes=("op", "dtype", "precision", "rule")),
    Pass("promote_in_kernel", lambda s: promote_in_kernel(s.gm),   # bf16 + fp32 upcasts as it reads: no copy
         when=_paints, when_says=_PAINTING, reads=("op", "inplace", "dtype", "rule"), writes=("rule",)),
    Pass("fused_attention_masks", lambda s: fused_attention_masks(s.gm),   # GPU sdpa kernels need mask stride 1
         when=_paints, when_says=_PAINTING, reads=("op",), writes=("op", "class", "precision", "rule")),
    Pass("measure_fp8_operands", lambda s: measure_fp8_operands(s.gm, s.calibration_data, s.config.fp8.margin),
         when=lambda s: s.config.fp8 is not None and s.calibration_data is not None,   # an analysis: bf16 runs
         when_says="at the fp8 level, with calibration_data", reads=("family", "precision"),
         writes=("fp8_calibration",)),
    Pass("lower_fp8_matmuls", lambda s: lower_fp8_matmuls(s.gm, s.config.fp8, s.low),   # after every bf16 decision
         when=lambda s: s.config.fp8 is not None, when_says="at the fp8 level (levels.py)",
         reads=("family", "precision", "module", "dtype", "op", "rule", "fp8_calibration"),
         writes=("rule", "op", "dtype")),   # op, dtype: on the scaling nodes it adds
), check=check_fx_graph, nodes=lambda s: list(s.gm.graph.nodes), front_end_facts=("hooks",))


def run_pipeline(gm: fx.GraphModule, config: AmpConfig, example_inputs=None,
                 calibration_data=None) -> dict[str, dict[str, int]]:
    """Run FX_PIPELINE on `gm` (in place); returns what each pass counted, by pass."""
    state = FxState(gm, config, example_inputs, calibration_data=calibration_data)
    counts = FX_PIPELINE.run(state)
    if state.paints:
        gm.graph.lint()
    gm.recompile()  # passes edit gm.graph; the Python code is generated once, here (none before: compile_graph)
    return counts
