"""Cast placement on ONNX: the ValueFlow of a model's main graph (bytes from each value's shape) for
the IR-neutral placement hook of painting/place_casts.py, the one convert() runs on fx graphs.

    decide_onnx_precision(model, rules, low, painted=(OnnxCastPlacement(model, keep_io_types=True),))
    pass counts += bytes_cast_before, bytes_cast_after, nodes_moved

Bytes are each value's fp32 size, a named dim (batch, sequence) counted as 32: exported models keep their
batch and sequence dims symbolic, and one figure for all of them keeps the sizes comparable (a seq x seq
score against a seq x hidden activation). Graph inputs hold their dtype; graph outputs want theirs back with
keep_io_types; initializers are free to read in either precision (a low reader's copy is stored low, no
Cast at run time), so they are not values of the flow; nodes painting leaves out hold their output's dtype,
and so does an output whose dtype an attribute fixes (RandomNormalLike, EyeLike with dtype=): never moved.
A node moves only if it has one float output of known rank. A model with subgraphs (If, Loop, Scan) is
left as painted: a value read inside a branch has readers the main graph does not show.
"""
from __future__ import annotations

import math

import onnx_ir as ir

from amp_compiler.passes.onnx.spec import follows_precision, input_role, is_float_value, subgraphs_of, tensor_dtype
from amp_compiler.passes.painting.place_casts import FP32, LOW, CastPlacement, ValueFlow

OUTPUT = "graph output"
INPUT = "graph input: "   # + the input's name: the flow's key for a value no node produces
OWN_DTYPE = "own dtype: "   # + the node's name: a value whose dtype an attribute fixes (RandomNormalLike...)
SYMBOLIC_DIM = 32   # what a named dim (batch, sequence) counts as: one figure for all, so sizes compare


def fp32_bytes(value: ir.Value) -> int | None:
    """The fp32 size of a float value of known rank, a symbolic dim counted as SYMBOLIC_DIM; None otherwise."""
    shape = value.shape
    if not is_float_value(value) or shape is None:
        return None
    return math.prod(d if isinstance(d, int) else SYMBOLIC_DIM for d in shape.dims) * 4


def _side(value: ir.Value) -> str:
    return FP32 if tensor_dtype(value) == ir.DataType.FLOAT else LOW


class OnnxCastPlacement:
    """A `painted` hook: builds the main graph's ValueFlow once painting has classified it, then places casts."""

    def __init__(self, model: ir.Model, keep_io_types: bool, method: str = "cut"):
        self.model, self.keep_io_types, self.counts, self.method = model, keep_io_types, {}, method

    def __call__(self, view) -> None:
        if any(subgraphs_of(node) for node in self.model.graph):
            return
        placement = CastPlacement(self.value_flow(view), self.method)
        placement(view)
        self.counts = placement.counts

    def value_flow(self, view) -> ValueFlow:
        graph = self.model.graph
        flow = ValueFlow(value_bytes={}, readers={}, fixed={OUTPUT: FP32})
        keys: dict[ir.Value, str] = {}
        for value in graph.inputs:
            size = fp32_bytes(value)
            if size is not None:
                keys[value] = key = INPUT + value.name
                flow.fixed[key], flow.value_bytes[key], flow.readers[key] = _side(value), size, []
        for node in graph:
            floats = [v for v in node.outputs if is_float_value(v)]
            size = fp32_bytes(floats[0]) if len(floats) == 1 else None
            if size is None:
                continue
            # An output whose dtype an attribute fixes is not the node's precision: its own key, fixed.
            key = node.name if follows_precision(node, floats[0].index()) else OWN_DTYPE + node.name
            keys[floats[0]] = key
            if node.name not in view or key != node.name:
                flow.fixed[key] = _side(floats[0])   # painting leaves it as it is, or an attribute fixes it
            flow.value_bytes[key], flow.readers[key] = size, []
        for node in graph:
            for index, value in enumerate(node.inputs):
                key = keys.get(value) if value is not None else None
                if key is not None and node.name in view and input_role(node, index) == "data" \
                        and node.name not in flow.readers[key]:
                    flow.readers[key].append(node.name)
        for value in graph.outputs:
            key = keys.get(value)
            if key is not None and self.keep_io_types and tensor_dtype(value) == ir.DataType.FLOAT:
                flow.readers[key].append(OUTPUT)
        for node in graph:
            if node.name not in view or node.name not in flow.value_bytes:
                continue
            inputs = [v for v in node.inputs if v is not None and is_float_value(v)]
            if all(v in keys or v.const_value is not None or v.is_initializer() for v in inputs):
                flow.movable.add(node.name)
        return flow
