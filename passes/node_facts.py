"""What a node carries: the one record every pass writes into `node.meta["amp"]` (fx and onnx_ir nodes alike).

    facts(node)["precision"]       # read (an empty record on a node no pass has seen yet)
    facts(node).update(op="linear")   # write

Keys, the pass that writes each, and what it means:
"""
from __future__ import annotations

from typing import Any, TypedDict

import torch

NodeFacts = TypedDict("NodeFacts", {
    # "key": type,  # the passes whose Pass(writes=...) name it (fx / onnx: that IR only; tests/passes/test_runner.py
    #                 checks these lists against the pipelines): what it means
    "op": str,                # canonicalize, lower_leaf_modules (fx), insert_casts (fx), cast_after_layout_ops (fx),
                              # fused_attention_masks (fx), lower_fp8_matmuls (fx): the canonical op name of op_policy
                              # ("linear", "cast", ...; "fp8_amax", "fp8_scale", "fp8_cast" on fp8 scaling nodes)
    "inplace": bool,          # canonicalize (fx): the op writes its first operand in place
    "module": str,            # decide_precision (fx), canonicalize (onnx), insert_casts (fx): the module path that owns the node
    "dtype": Any,             # infer_dtypes (fx), insert_casts (fx), cast_after_layout_ops (fx), lower_fp8_matmuls (fx):
                              # torch.dtype of the value, None when not a tensor / unknown
    "original_dtype": Any,    # infer_dtypes (fx): the dtype the value had before painting (an int stays an int)
    "class": str,             # mark_unchanged (fx), decide_precision, lower_leaf_modules (fx), insert_casts (fx),
                              # fused_attention_masks (fx): allow | infer | deny | clear | ignore | io | cast | opaque ...
    "family": str,            # mark_unchanged (fx), decide_precision: the op family of the policy table (matmul, norm, ...)
    "reason": str,            # decide_precision: the policy table's reason for the class
    "precision": str | None,  # mark_unchanged (fx), decide_precision, lower_leaf_modules (fx), insert_casts (fx),
                              # cast_after_layout_ops (fx), fused_attention_masks (fx), store_moved_weights_low (onnx):
                              # "low" | "fp32" | None (not painted: ints, shapes, io)
    "rule": str,              # mark_unchanged (fx), decide_precision, plan_opaque_calls (fx), lower_leaf_modules (fx),
                              # insert_casts (fx), cast_after_layout_ops (fx), promote_in_kernel (fx),
                              # fused_attention_masks (fx), lower_fp8_matmuls, store_moved_weights_low (onnx):
                              # why the node has its precision
    "forced": str,            # decide_precision (onnx): which user rule forced the node
    "fp32_weights": bool,     # decide_precision (fx): a low op that keeps fp32 weights (mixed-kernel norms)
    "range": dict,            # calibrate_ranges: samples, max_abs, overflows, read_max, read_from, below_normal
    "hooks": list,            # front end (fx): the user hooks on the module a call_module node calls; it stays a call
    "warning": str,           # warn_constants_beyond_fp16 (fx): a constant beyond fp16 that reaches a float16 op
    "fp8_calibration": dict,  # measure_fp8_operands (fx): samples, x_amax, w_amax, x_error, w_error, x_error_rowwise,
                              # w_error_rowwise: a low matmul's operands through e4m3 on calibration_data
}, total=False)

ROLE = "amp_role"   # node.meta[ROLE]: "cast" | "loss_scale" | "unscale" | "overflow_check" on nodes the passes add


def facts(node) -> NodeFacts:
    """The node's record, created empty on first use."""
    return node.meta.setdefault("amp", {})


def node_dtype(node) -> torch.dtype | None:
    return facts(node).get("dtype")
