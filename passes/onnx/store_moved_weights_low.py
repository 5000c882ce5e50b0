"""Store a weight in the low dtype when fp32 ops only move it: the mover runs low, one Cast lifts its output.

    rows = Gather(table_f32, ids)   [fp32: feeds a LayerNorm]   ->   rows_f16 = Gather(table_f16, ids)   [low]
    w_f16 = Cast(table_f32, FLOAT16)  [a tied head reads it low]     rows = Cast(rows_f16, FLOAT)
    LayerNorm(rows + pos)                                            LayerNorm(rows + pos); the head reads table_f16

Why: painting (convert_onnx) and convert() (export_onnx: an embedding lookup keeps its table's dtype) leave
a lookup fp32 when its neighbours are (BERT's table feeds an fp32 norm), and then its table, often the
largest weight of the model, keeps fp32 storage (and a tied LM head adds an fp16 copy). A data-movement op
(Gather, Reshape, Slice, Transpose... : the policy's clear class, family "shape", "moves values without
changing them") computes nothing, so moving fp16 values and casting the result up gives exactly the
fp16-rounded weight: storage rounding is the only loss, the one every other fp16 weight already takes.

Runs on both entry points' typed graphs, once every Cast is in place and before fold_onnx_casts (which then
drops the Casts to low that read the stored weight). An initializer qualifies when every reader is a Cast to
the low dtype, or a mover reading it as data with the weight as its only float data input (Concat(table,
x_f32) would round x as well), when no mover's fp32 was forced (decide's facts: block lists, the user's
patterns, an op the schema or ONNX Runtime cannot run low; the rules' force_fp32 patterns on an export) and
when fp16 holds it (a table beyond 65504 stays fp32 and exact). A table already stored low that fp32 movers
read through a Cast up (a converted model converted again) qualifies the same way: the movers read it
directly, so converting twice changes nothing. Movers get precision "low" with the rule that says why;
counts weights and movers.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.onnx.canonicalize import canonical_onnx_op, module_path
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, cast_graph_output, cast_target, is_cast, make_cast, \
    set_tensor_dtype
from amp_compiler.passes.onnx.spec import input_role, is_float_value
from amp_compiler.passes.onnx.torch_origin import origin_node_name
from amp_compiler.passes.policy.numerics import FP16_MAX, dtype_name
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.runner import PassResult

MOVER = ("clear", "shape")   # (class, family) in passes/policy/op_policy.py: "moves values without changing them"


def store_moved_onnx_weights_low(model: ir.Model, low: ir.DataType, rules: PrecisionRules) -> PassResult:
    names = UniqueNames(model)
    weights = movers = 0
    for graph in model.graphs():
        for weight in list(graph.initializers.values()):
            found = _movers_of(weight, low, rules)
            if found is None:
                continue
            readers, ups = found
            if weight.dtype == ir.DataType.FLOAT:
                weight.const_value = ir.Tensor(weight.const_value.numpy().astype(low.numpy()), name=weight.name)
                set_tensor_dtype(weight, low)
            for up in ups:   # movers that read the low weight through a Cast up read it directly
                for use in list(up.outputs[0].uses()):
                    use.node.replace_input_with(use.idx, weight)
                up.graph.remove(up, safe=True)
            for node in readers:
                _lift_outputs(node, low, names)
                facts(node)["precision"] = "low"
                facts(node)["rule"] = (f"clear: only moves weight {weight.name}, stored in {dtype_name(low)} "
                                       "(storage rounding only); one Cast up for its fp32 readers")
            weights += 1
            movers += len(readers)
    return PassResult(modified=weights > 0, counts={"moved_weights_stored_low": weights,
                                                    "weight_movers_lowered": movers})


def _movers_of(weight: ir.Value, low: ir.DataType, rules: PrecisionRules):
    """(movers, Casts up between the weight and them) when `weight` qualifies (module docstring); else None."""
    if weight.dtype not in (ir.DataType.FLOAT, low) or weight.const_value is None or weight.is_graph_input() or \
            weight.is_graph_output():
        return None
    movers: dict[ir.Node, None] = {}
    ups: dict[ir.Node, None] = {}
    for use in weight.uses():
        node = use.node
        if is_cast(node) and cast_target(node) == low:
            continue
        if weight.dtype == low and is_cast(node) and cast_target(node) == ir.DataType.FLOAT and \
                not node.outputs[0].is_graph_output():
            read = [(u.node, u.idx, node.outputs[0]) for u in node.outputs[0].uses()]
            ups[node] = None
        elif weight.dtype == ir.DataType.FLOAT:
            read = [(node, use.idx, weight)]
        else:
            return None
        for reader, index, value in read:
            if not _only_moves(reader, index, value, rules):
                return None
            movers[reader] = None
    if not movers:   # only Casts to low read it: fold_onnx_casts stores it low
        return None
    if low == ir.DataType.FLOAT16 and weight.dtype == ir.DataType.FLOAT and \
            _peak(weight.const_value.numpy()) > FP16_MAX:
        return None
    return list(movers), list(ups)


def _only_moves(node: ir.Node, index: int, value: ir.Value, rules: PrecisionRules) -> bool:
    """`node` is an fp32 mover, not forced fp32, that reads `value` as data and no other float data."""
    if input_role(node, index) != "data" or rules.classify(canonical_onnx_op(node))[:2] != MOVER or \
            facts(node).get("forced") or _forced_fp32(node, rules):
        return False
    return all(v is value for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data")


def _forced_fp32(node: ir.Node, rules: PrecisionRules) -> bool:
    forced = rules.forced(module_path(node), origin_node_name(node))
    return forced is not None and forced[0] == "fp32"


def _lift_outputs(node: ir.Node, low: ir.DataType, names: UniqueNames) -> None:
    """The mover writes `low`; its readers (and the graph, for an output) read a Cast back to fp32."""
    for output in node.outputs:
        if not is_float_value(output) or output.dtype != ir.DataType.FLOAT:
            continue
        uses = list(output.uses())
        set_tensor_dtype(output, low)
        if uses:
            up = make_cast(output, ir.DataType.FLOAT, names).outputs[0]
            for use in uses:
                use.node.replace_input_with(use.idx, up)
        graph = node.graph
        for index, value in enumerate(list(graph.outputs)):
            if value is output:
                cast_graph_output(graph, index, ir.DataType.FLOAT, names)


def _peak(array: np.ndarray) -> float:
    finite = np.abs(array[np.isfinite(array)])
    return float(finite.max()) if finite.size else 0.0
