"""Store a weight once: initializers that hold the same values, or one the transpose of the other, become one.

    rows = Gather(table_f16, ids)  ...  logits = MatMul(h, head_f16)         head_f16 == table_f16.T (a tied LM head)
        ->   rows = Gather(table_f16, ids)  ...  logits = MatMul(h, Transpose(table_f16))
    two initializers with the same dtype, shape and bytes   ->   one (its readers share it)

A tied LM head (GPT-2: lm_head.weight is transformer.wte.weight) reaches the exporter as one parameter read
twice, by the lookup and by the head's linear; the exporter's optimizer folds the head's transposed weight
(Transpose, Cast) into a second initializer, so the file stores the table twice. The values decide, not the
names: a copy whose bytes equal another initializer's, or its transpose's (2-D, non-square), is the same
weight, and reading it through a Transpose computes the same bits (ONNX Runtime folds that Transpose of a
constant when it loads the model). The initializer listed first is kept. Run after fold_onnx_casts, when
every weight is stored in the dtype its readers take. Counts the copies removed and their bytes.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np
import onnx_ir as ir

from amp_compiler.passes.onnx.cast_nodes import UniqueNames
from amp_compiler.passes.onnx.spec import is_float_value
from amp_compiler.passes.runner import PassResult


def store_onnx_tied_weights_once(model: ir.Model) -> PassResult:
    names = UniqueNames(model)
    removed = saved = 0
    for graph in model.graphs():
        weights = [w for w in graph.initializers.values() if _candidate(w)]
        kept: dict[tuple, ir.Value] = {}
        by_shape: dict[tuple, list[ir.Value]] = defaultdict(list)
        for weight in weights:
            by_shape[weight.dtype, tuple(weight.const_value.shape)].append(weight)
        for weight in weights:
            dtype, shape = weight.dtype, tuple(weight.const_value.shape)
            same = len(by_shape[dtype, shape]) > 1
            swapped = len(shape) == 2 and shape[0] != shape[1] and (dtype, shape[::-1]) in by_shape
            if not (same or swapped):
                continue
            array = weight.const_value.numpy()
            key = (dtype, shape, _digest(array))
            original = kept.get(key)
            if original is not None and np.array_equal(original.const_value.numpy(), array):
                weight.replace_all_uses_with(original)
            elif swapped and (transposed := _transposed_original(kept, dtype, shape, array)) is not None:
                weight.replace_all_uses_with(_transpose(transposed, graph, names))
            else:
                kept.setdefault(key, weight)
                continue
            graph.initializers.pop(weight.name)
            removed += 1
            saved += weight.const_value.nbytes
    return PassResult(modified=removed > 0, counts={"tied_weight_copies_removed": removed,
                                                    "tied_weight_bytes_saved": saved})


def _candidate(weight: ir.Value) -> bool:
    return is_float_value(weight) and weight.const_value is not None and not weight.is_graph_input() and \
        not weight.is_graph_output() and weight.const_value.size > 1


def _transposed_original(kept: dict, dtype, shape: tuple, array: np.ndarray) -> ir.Value | None:
    """The kept initializer whose transpose holds `array`, if any."""
    flipped = np.ascontiguousarray(array.T)
    original = kept.get((dtype, shape[::-1], _digest(flipped)))
    if original is not None and np.array_equal(original.const_value.numpy(), flipped):
        return original
    return None


def _transpose(weight: ir.Value, graph: ir.Graph, names: UniqueNames) -> ir.Value:
    """A Transpose of `weight` placed first in `graph` (one per weight, shared by every copy it replaces)."""
    for use in weight.uses():
        if use.node.op_type == "Transpose" and use.node.domain in ("", "ai.onnx") and use.node.graph is graph and \
                use.node.attributes.get("perm") is not None and list(use.node.attributes["perm"].as_ints()) == [1, 0]:
            return use.node.outputs[0]
    name = names.value(f"{weight.name}_transposed")
    rows, columns = weight.const_value.shape
    output = ir.Value(name=name, type=ir.TensorType(weight.dtype), shape=ir.Shape([columns, rows]))
    node = ir.Node("", "Transpose", [weight], [ir.AttrInt64s("perm", [1, 0])], outputs=[output],
                   name=names.node(name))
    if len(graph):
        graph.insert_before(graph[0], node)
    else:
        graph.append(node)
    return output


def _digest(array: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()
