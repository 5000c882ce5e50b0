"""Run in fp32 the low-precision nodes ONNX Runtime refuses to execute, with casts around them.

    y = ScatterND(x_f16, i, u_f16, reduction="add")      ->   x_float32 = Cast(x_f16); u_float32 = Cast(u_f16)
                                                              y = ScatterND(x_float32, i, u_float32) (fp32)
                                                              y_float16 = Cast(y)  -> y's readers

ONNX Runtime registers fp16 ScatterND/ScatterElements kernels that fail at run time for some reductions
(passes/onnx/spec.py lists them). convert() may rightly run them in fp16 for training in torch; the
exported model keeps every other decision and runs just these nodes in fp32. convert_onnx never needs
this pass: its painting keeps such nodes fp32 in the first place.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, low_data_dtype, run_fp32_between_casts
from amp_compiler.passes.onnx.spec import low_precision_blocker
from amp_compiler.passes.runner import PassResult


def widen_refused_onnx_nodes(model: ir.Model) -> PassResult:
    names = UniqueNames(model)
    opset = model.opset_imports.get("", 1)
    widened = 0
    for node in list(all_nodes(model.graph)):
        low = low_data_dtype(node, only_low=False)
        if low is None or low_precision_blocker(node, low, opset) is None:
            continue
        run_fp32_between_casts(node, low, names)
        widened += 1
    return PassResult(modified=widened > 0, counts={"refused_nodes_widened": widened})
