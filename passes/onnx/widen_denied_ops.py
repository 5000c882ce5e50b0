"""Run in fp32, as the policy table says, the fragile ops that torch.onnx writes out of ops convert() ran low.

    scaled_dot_product_attention (allow: convert() runs it fp16)   --torch.onnx-->   ... MatMul -> Softmax_f16 ...
        ->   ... MatMul -> Cast(FLOAT) -> Softmax (fp32) -> Cast(FLOAT16) -> ...    "deny: softmax" (op_policy)
    adaptive_avg_pool2d (infer: low)   --torch.export decomposes-->   ReduceMean_f16   ->   ReduceMean in fp32

convert() decides one fx node at a time. sdpa is an allow op: torch runs it as one fused kernel that keeps
its softmax statistics in fp32. ONNX (opset 18) has no such kernel, so the exporter writes the attention out
as MatMul, Add, Softmax, MatMul in the dtype of the call: the Softmax becomes a plain fp16 node no rule ever
looked at, while convert_onnx keeps every Softmax fp32 because the table denies it. Likewise a global average
pool (a pooling op, infer) is exported as a ReduceMean (a reduction, deny). One table, one decision: an
exported node that runs low and whose canonical op the rules deny runs fp32 between casts, unless convert()
itself painted an op of that family low (norms reading low activations where the level says so, anything a
user's force_low pattern names: `low_families`), or a force_low pattern names the node's module or the
torch node it came from. Ops the table does not know (and other domains) are left as exported. Reads rules
(the conversion's PrecisionRules) and low_families (from the converted GraphModule); counts the nodes widened.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes, canonical_onnx_op, module_path
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, low_data_dtype, run_fp32_between_casts
from amp_compiler.passes.onnx.torch_origin import origin_node_name
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.runner import PassResult


def widen_denied_onnx_ops(model: ir.Model, rules: PrecisionRules, low_families=frozenset()) -> PassResult:
    names = UniqueNames(model)
    widened = 0
    for node in list(all_nodes(model.graph)):
        low = low_data_dtype(node, only_low=True)
        if low is None or node.domain not in ("", "ai.onnx"):
            continue
        op_class, family, _ = rules.classify(canonical_onnx_op(node))
        if op_class != "deny" or family in low_families or family == "unknown":
            continue
        forced = rules.forced(module_path(node), origin_node_name(node))
        if forced is not None and forced[0] == "low":
            continue
        run_fp32_between_casts(node, low, names)
        widened += 1
    return PassResult(modified=widened > 0, counts={"denied_nodes_widened": widened})
