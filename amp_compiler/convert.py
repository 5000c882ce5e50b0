"""convert(): the whole compiler as one readable pipeline.

    trace -> canonicalize -> propagate_values -> infer_dtypes -> decide_fx_precision -> plan_opaque_calls
          -> lower_leaf_modules -> infer_dtypes -> insert_casts -> fold_casts -> cast_after_layout_ops
          -> GraphModule (+ gm.meta["amp"] summary)
A model whose own forward cannot be captured runs as written with its children converted
(convert_children).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.config import AmpConfig, make_config
from amp_compiler.convert_children import convert_children
from amp_compiler.frontend import TracingError, trace
from amp_compiler.insight.graph_decisions import preserve_decisions
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.cast_after_layout_ops import cast_after_layout_ops
from amp_compiler.passes.fx.decide_precision import decide_fx_precision
from amp_compiler.passes.fx.fold_casts import count_casts, fold_casts
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.insert_casts import insert_casts, output_value_nodes
from amp_compiler.passes.fx.lower_leaf_modules import lower_leaf_modules
from amp_compiler.passes.fx.opaque_calls import plan_opaque_calls
from amp_compiler.passes.fx.propagate_values import propagate_values


def convert(model: nn.Module, level: str = "O1", *, example_inputs: tuple | None = None,
            dynamic_shapes=None, **overrides) -> fx.GraphModule:
    """Trace `model` and return a GraphModule whose every node runs in the precision the rules pick.

    The result shares the model's parameters and buffers (an optimizer on model.parameters() trains it)
    and never changes the model. `amp_compiler.explain(gm)` tells why each node got its dtype.
    `dynamic_shapes` (torch.export's format) is used when the model needs the torch.export front end;
    by default every dim torch.export can keep dynamic stays dynamic.
    """
    config = make_config(level, **overrides)
    try:
        traced = trace(model, example_inputs, dynamic_shapes)
    except TracingError as error:
        if example_inputs is None or not any(True for _ in model.children()):
            raise
        return convert_children(model, error, convert, level, example_inputs, **overrides)
    gm = traced.graph_module
    counts = run_pipeline(gm, config, example_inputs)
    gm.meta["amp"] = {
        "level": config.level, "requested_level": config.requested_level,
        "dtype": config.low_dtype_name, "frontend": traced.frontend, "leaf_modules": traced.leaves,
        "notes": traced.notes, "opaque": traced.opaque, "keep_io_types": config.keep_io_types, "casts": count_casts(gm),
        "pass_counts": counts, "loss_scale_manager": config.loss_scale_manager,
    }
    preserve_decisions(gm)   # explain/render/compare keep working after torch.save / torch.load
    return gm


def run_pipeline(gm: fx.GraphModule, config: AmpConfig, example_inputs=None) -> dict[str, int]:
    """Run the passes in order on `gm` (in place); returns what each pass counted."""
    low = config.low_dtype
    canonicalize(gm)
    if example_inputs is not None and not any("val" in n.meta for n in gm.graph.nodes):
        propagate_values(gm, example_inputs)            # fake values (torch.export records its own)
    infer_dtypes(gm, example_inputs, low)               # original dtypes: what is float, what we return
    original_outputs = [n.meta["amp"]["dtype"] for n in output_value_nodes(gm)]
    if config.level == "O0":
        for node in gm.graph.nodes:
            node.meta["amp"].update({"class": "-", "family": "-", "precision": None, "rule": "O0: unchanged"})
        return {}
    counts: dict[str, int] = {}
    steps = (
        lambda: decide_fx_precision(gm, config.precision_rules()),  # paint low/fp32 on every float node
        lambda: plan_opaque_calls(gm, low),        # opaque bodies run under autocast, outputs as before
        lambda: lower_leaf_modules(gm, low),       # low leaves read their params via get_attr: castable
        lambda: infer_dtypes(gm, example_inputs, low),  # re-run: dtypes the painted graph computes in
        lambda: insert_casts(gm, low, original_outputs, config.keep_io_types),
        lambda: fold_casts(gm),                     # cleans up whatever the inserts left
        lambda: cast_after_layout_ops(gm),          # a transposed low activation slows matmuls 100x
    )
    for step in steps:
        counts.update(step().counts)
    gm.graph.lint()
    gm.recompile()  # passes edit gm.graph; the Python code is generated once, here
    return counts
