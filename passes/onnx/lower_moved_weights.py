"""Store an exported fp32 weight in the low dtype when its readers only move it; one Cast lifts what they move.

    rows = Gather(table_f32, ids)     [feeds an fp32 LayerNorm]   ->   rows_f16 = Gather(table_f16, ids)
    w_f16 = Cast(table_f32, FLOAT16)  [a tied head reads it low]       rows = Cast(rows_f16, FLOAT)
                                                                       (the head reads table_f16: one table)

convert() keeps an embedding lookup in the dtype of its table (policy class "ignore": a lookup computes
nothing), so an export keeps the table fp32 when the lookup feeds fp32 ops, and a tied LM head adds an fp16
copy of the same table. A data-movement op (Gather, Reshape, Slice, Transpose...: the policy's clear class,
family "shape", "moves values without changing them") reading fp16 values and a Cast of its output give
exactly the fp16-rounded weight: storage rounding is the only loss, the one every other fp16 weight takes.
This is the export's twin of store_moved_weights_low (convert_onnx), which does it by repainting.

A weight qualifies when it is an fp32 initializer whose every reader either casts it to the low dtype or is
such a mover with the weight as its only float data input, and when fp16 holds it (|x| <= 65504: a larger
table stays fp32 and exact). Movers named by a force_fp32 pattern keep their fp32 table. Run before
fold_onnx_casts, which removes the Casts to low that now read a low weight; lower_movers_between_casts then
lets movers whose readers only cast down read the low rows directly. Counts weights and movers.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import canonical_onnx_op, module_path
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, cast_graph_output, cast_target, is_cast, make_cast, \
    set_tensor_dtype
from amp_compiler.passes.onnx.spec import input_role, is_float_value
from amp_compiler.passes.onnx.torch_origin import origin_node_name
from amp_compiler.passes.policy.numerics import FP16_MAX
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.runner import PassResult

MOVER = ("clear", "shape")   # (class, family) in passes/policy/op_policy.py: "moves values without changing them"


def lower_moved_onnx_weights(model: ir.Model, low: ir.DataType, rules: PrecisionRules) -> PassResult:
    names = UniqueNames(model)
    weights = movers = 0
    for graph in model.graphs():
        for weight in list(graph.initializers.values()):
            readers = _movers_of(weight, low, rules)
            if readers is None:
                continue
            array = weight.const_value.numpy()
            weight.const_value = ir.Tensor(array.astype(low.numpy()), name=weight.name)
            set_tensor_dtype(weight, low)
            for node in readers:
                _lift_outputs(node, low, names)
            weights += 1
            movers += len(readers)
    return PassResult(modified=weights > 0, counts={"moved_weights_stored_low": weights,
                                                    "weight_movers_lowered": movers})


def is_mover(node: ir.Node, rules: PrecisionRules) -> bool:
    return rules.classify(canonical_onnx_op(node))[:2] == MOVER


def _movers_of(weight: ir.Value, low: ir.DataType, rules: PrecisionRules) -> list[ir.Node] | None:
    """The movers that read `weight`, when it qualifies (see the module docstring); else None."""
    if weight.dtype != ir.DataType.FLOAT or weight.const_value is None or weight.is_graph_input() or \
            weight.is_graph_output() or not weight.uses():
        return None
    movers: dict[ir.Node, None] = {}
    for use in weight.uses():
        node = use.node
        if is_cast(node) and cast_target(node) == low:
            continue
        float_inputs = [v for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data"]
        if input_role(node, use.idx) != "data" or not is_mover(node, rules) or \
                any(v is not weight for v in float_inputs) or _forced_fp32(node, rules):
            return None
        movers[node] = None
    if not movers:   # only Casts to low read it: fold_onnx_casts stores it low
        return None
    if low == ir.DataType.FLOAT16 and _peak(weight.const_value.numpy()) > FP16_MAX:
        return None
    return list(movers)


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
