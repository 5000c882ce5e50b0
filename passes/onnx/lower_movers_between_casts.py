"""A data-movement op that reads a Cast up and is read only by Casts back down runs in the low dtype.

    up = Cast(x_f16, FLOAT); t = Transpose(up); y = Cast(t, FLOAT16)    ->    y = Transpose(x_f16)
    (also through a chain of movers: Reshape -> Transpose -> Cast down)      (up stays if other fp32 ops read it)

Exact: a mover (the policy's clear class, family "shape": Transpose, Reshape, Gather, Slice...) changes no
value, and fp16 -> fp32 -> fp16 is the identity, so the rewritten graph computes the same bits with fewer
Casts. The export needs it where convert() left a mover on the fp32 side of a boundary that a later pass moved
(an embedding table stored low by store_moved_weights_low: its rows are cast up, and a Transpose that only fed a
low MatMul through a Cast down can read them low). A mover with an fp32 reader, or whose output is a graph
output, is left alone. Counts the movers lowered and the Casts removed.
"""
from __future__ import annotations

import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import canonical_onnx_op
from amp_compiler.passes.onnx.cast_nodes import bypass_cast, cast_target, is_cast, set_tensor_dtype
from amp_compiler.passes.onnx.spec import FLOAT_TYPES, input_role, is_float_value, tensor_dtype
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.runner import PassResult

_LOW = tuple(t for t in FLOAT_TYPES if t != ir.DataType.FLOAT)


def lower_onnx_movers_between_casts(model: ir.Model) -> PassResult:
    movers = casts = 0
    for graph in model.graphs():
        for up in list(graph):
            if up.graph is not graph or not _is_cast_up(up):
                continue
            low, source = tensor_dtype(up.inputs[0]), up.outputs[0]
            for reader in list(dict.fromkeys(use.node for use in source.uses())):
                region = _region(reader, source, low)
                if region is None:
                    continue
                region_movers, downs = region
                for i, value in enumerate(reader.inputs):
                    if value is source:
                        reader.replace_input_with(i, up.inputs[0])
                for mover in region_movers:
                    for output in mover.outputs:
                        if tensor_dtype(output) == ir.DataType.FLOAT:
                            set_tensor_dtype(output, low)
                for down in downs:
                    bypass_cast(down)
                movers += len(region_movers)
                casts += len(downs)
            if not up.outputs[0].uses() and not up.outputs[0].is_graph_output():
                graph.remove(up, safe=True)
                casts += 1
    return PassResult(modified=movers > 0, counts={"movers_lowered": movers, "casts_removed": casts})


def _is_cast_up(node: ir.Node) -> bool:
    return is_cast(node) and cast_target(node) == ir.DataType.FLOAT and tensor_dtype(node.inputs[0]) in _LOW


def _region(node: ir.Node, value: ir.Value, low: ir.DataType) -> tuple[list[ir.Node], list[ir.Node]] | None:
    """(movers, casts down) when `node`, reading fp32 `value`, is a mover whose every reader, through other
    such movers, is a Cast to `low`; else None."""
    if not _is_mover(node):
        return None
    floats = [v for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data"]
    if any(v is not value for v in floats):
        return None
    movers, downs = {node: None}, {}
    for output in node.outputs:
        if not is_float_value(output):
            continue
        if output.dtype != ir.DataType.FLOAT or output.is_graph_output():
            return None
        for reader in dict.fromkeys(use.node for use in output.uses()):
            if is_cast(reader) and cast_target(reader) == low:
                downs[reader] = None
                continue
            inner = _region(reader, output, low)
            if inner is None:
                return None
            movers.update(dict.fromkeys(inner[0]))
            downs.update(dict.fromkeys(inner[1]))
    return (list(movers), list(downs)) if downs else None


def _is_mover(node: ir.Node) -> bool:
    rule = POLICY.get(canonical_onnx_op(node))
    return rule is not None and (rule.op_class, rule.family) == ("clear", "shape")
