"""convert(): the compiler's entry point.

    convert(model)               = compile_graph(capture(model), config)   (graph_conversion.py, FX_PIPELINE)
    convert(model, inplace=True) = amp_compiler.compile(model, backend="eager")   (dynamo/: each graph dynamo makes
                                   goes through compile_graph)
A model whose own forward cannot be captured runs as written with its children converted (convert_children).
`amp-compiler pipelines` prints every pass (passes/pipelines.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.config import make_config
from amp_compiler.convert_children import convert_children
from amp_compiler.dynamo.compile import compile as compile_on_dynamo
from amp_compiler.dynamo.in_place import capture_now, refuse_in_place_request
from amp_compiler.frozen import freeze as freeze_weights
from amp_compiler.frontend import TracingError, capture
from amp_compiler.graph_conversion import collector_paused, compile_graph
from amp_compiler.passes.painting.calibrate_ranges import check_calibration_data


def convert(model: nn.Module, level: str = "O1", *, dtype: torch.dtype | str | None = None,
            example_inputs: tuple | None = None, dynamic_shapes=None, calibration_data=None, freeze: bool = False,
            inplace: bool = False, capture: str | None = None, **overrides) -> fx.GraphModule | nn.Module:
    """Trace `model` and return a GraphModule whose every node runs in the precision the rules pick.

    `dtype`: the low precision, torch.float16 or torch.bfloat16 (or "float16"/"bfloat16"); None means
    float16, except bfloat16 at level "fp8" and, at level "auto", float16 on CUDA and bfloat16 elsewhere.
    Returns an fx.GraphModule; with inplace=True the model itself (its class unchanged); a model the
    front ends cannot capture whole comes back as written with its children converted (an nn.Module).
    `overrides`: the rule options (force_fp32=, force_low=, allow_ops=, deny_ops=, keep_batchnorm_fp32=,
    keep_io_types=, loss_scale_manager=, the fp8 options; amp_compiler.make_config lists them all).

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
    if dtype is not None:
        overrides["dtype"] = dtype
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
    refuse_in_place_request(model, example_inputs)
    compile_on_dynamo(model, level, backend="eager", weight_cache=weight_cache, calibration_data=calibration_data,
                      **overrides)
    capture_now(model, example_inputs)
    return model


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


