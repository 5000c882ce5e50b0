"""Store a weight in the low dtype when fp32 ops only move it: the mover runs low, one Cast lifts its output.

    rows = Gather(table_f32, ids)   [fp32: feeds a LayerNorm]   ->   rows_f16 = Gather(table_f16, ids)   [low]
    LayerNorm(rows + pos)                                            rows = Cast(rows_f16, FLOAT)
                                                                     LayerNorm(rows + pos)

Why: painting leaves an embedding lookup fp32 when its neighbours are (BERT's table feeds an fp32 norm),
and then its table, often the largest weight of the model, keeps fp32 storage. A data-movement op
(Gather, Reshape, Slice, Transpose... : the policy's clear class, family "shape", "moves values without
changing them") computes nothing, so moving fp16 values and casting the result up gives exactly the
fp16-rounded weight: storage rounding is the only loss, the one every other fp16 weight already takes.

An initializer qualifies when every reader reads it as data and either runs low anyway or is such a mover
painted fp32 with the weight as its only float data input (Concat(table, x_f32) would round x as well).
Movers whose fp32 was forced (block lists, the user's patterns, a constant beyond 65504, an op the
schema or ONNX Runtime cannot run low) keep it: a table above 65504 stays fp32 and exact.
fold_onnx_casts then stores the weight converted; insert_onnx_casts places the single Cast up, shared by
the mover's fp32 readers. A converted model qualifies again in the same way, so converting it twice
changes nothing. Reads and rewrites facts(node) (precision, rule); counts weights and movers.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.onnx.spec import input_role, is_float_value
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts

MOVER_CLASS, MOVER_FAMILY = "clear", "shape"   # passes/policy/op_policy.py: "moves values without changing them"


def store_moved_onnx_weights_low(model: ir.Model, low: ir.DataType) -> PassResult:
    weights = movers = 0
    for graph in model.graphs():
        for weight in graph.initializers.values():
            fp32_movers = _fp32_movers_of(weight)
            for node in fp32_movers:
                facts(node)["precision"] = "low"
                facts(node)["rule"] = (f"clear: only moves weight {weight.name}, stored in {dtype_name(low)} "
                                            "(storage rounding only); one Cast up for its fp32 readers")
            weights += bool(fp32_movers)
            movers += len(fp32_movers)
    return PassResult(modified=weights > 0,
                      counts={"moved_weights_stored_low": weights, "weight_movers_lowered": movers})


def _fp32_movers_of(weight: ir.Value) -> list[ir.Node]:
    """The fp32 movers to run low so that `weight` is stored low only; [] when the weight does not qualify."""
    if not is_float_value(weight) or weight.const_value is None or weight.is_graph_input() or \
            weight.is_graph_output():
        return []
    movers: dict[ir.Node, None] = {}
    for use in weight.uses():
        node = use.node
        amp = facts(node)
        if input_role(node, use.idx) != "data":
            return []
        if amp.get("precision") == "low":
            continue
        if amp.get("precision") != "fp32" or amp.get("forced") or not _only_moves(node, weight):
            return []
        movers[node] = None
    return list(movers)


def _only_moves(node: ir.Node, weight: ir.Value) -> bool:
    amp = facts(node)
    if (amp.get("class"), amp.get("family")) != (MOVER_CLASS, MOVER_FAMILY):
        return False
    return all(value is weight for i, value in enumerate(node.inputs)
               if is_float_value(value) and input_role(node, i) == "data")
