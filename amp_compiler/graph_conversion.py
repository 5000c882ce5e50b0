"""compile_graph(): one captured graph through FX_PIPELINE (passes/pipelines.py) into a converted GraphModule.

    capture (frontend/capture.py: the only place a model is traced; seconds on an LLM)
      -> compile_graph: a copy of the captured graph -> FX_PIPELINE (canonicalize ... decide_precision ...
         insert_casts -> fold_casts -> ...; tens of milliseconds) -> GraphModule (+ gm.meta["amp"] summary)

One capture can be compiled many times (export_onnx compiles it again with force_fp32); convert() and each
graph TorchDynamo makes (dynamo/backend.py) come through here.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch.fx as fx
from torch import nn

from amp_compiler.config import AmpConfig, with_model_lists
from amp_compiler.frozen import freeze as freeze_weights
from amp_compiler.frontend import CapturedGraph, capture, graph_module_to_compile
from amp_compiler.frontend.hooks import hook_fates, user_hooks_silenced
from amp_compiler.frontend.fx_capture import keep_output_type_when_saved
from amp_compiler.frontend.training_reads import READS, follow_training_flags
from amp_compiler.passes.fx.fold_casts import count_casts
from amp_compiler.passes.pipelines import run_fx_pipeline
from amp_compiler.saved_decisions import preserve_decisions
from amp_compiler.target_devices import target_devices


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
        counts = run_fx_pipeline(gm, config, example_inputs, calibration_data)
    gm.meta["amp"] = {
        "level": config.level, "requested_level": config.requested_level,
        "dtype": config.low_dtype_name, "frontend": captured.frontend, "leaf_modules": list(captured.leaves),
        "notes": list(captured.notes), "opaque": dict(captured.opaque), "keep_io_types": config.keep_io_types,
        "casts": count_casts(gm), "pass_counts": counts, "loss_scale_manager": config.loss_scale_manager,
        "devices": {"devices": list(config.devices), "from": devices_from},
        "hooks": hook_fates(gm, captured.hooked, captured.frontend), "training_reads": dict(captured.training_reads),
    }
    preserve_decisions(gm)   # explain/render/compare keep working after torch.save / torch.load
    keep_output_type_when_saved(gm)   # a ModelOutput stays one after torch.save / torch.load
    if captured.training_reads and follow_flags:   # `if self.training:` was decided at capture: a call in another mode captures again
        gm.__dict__[READS] = dict(captured.training_reads)
        follow_training_flags(gm, model, convert_again or (lambda copy, **given: compile_graph(
            capture(copy, example_inputs, captured.dynamic_shapes), config, calibration_data, freeze=freeze)))
    return freeze_weights(gm) if freeze else gm
