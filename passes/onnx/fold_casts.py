"""Clean up the Casts of an ONNX model until none can go, without changing a single computed value.

    Cast(Cast(x_i64, FLOAT), FLOAT16)       ->  Cast(x_i64, FLOAT16)       (exact pairs only: cast_pair_folds;
                                                                        the inner Cast is retargeted if only
                                                                        the outer one reads it)
    Cast(x_f16, FLOAT16)                    ->  x_f16
    Cast(w_initializer_f32, FLOAT16)        ->  w stored as fp16 (a new w_float16 when fp32 readers remain)
    Cast(Constant / ConstantOfShape, FLOAT16)  ->  the same op holding fp16 values
    two Cast(x, FLOAT16) in one graph       ->  one

Weights are converted here, once, at conversion time: no runtime Cast reads an initializer afterwards.
Values that overflow fp16 are converted exactly as ONNX Runtime's Cast would (to inf) and counted in
"constant_values_overflowed": deciding not to cast them is the painting's job, not the folder's.
fp32 -> fp16 -> fp32 is never folded (it rounds; ONNX Runtime stopped removing it in 1.17).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from amp_compiler.passes.onnx.cast_nodes import UniqueNames, bypass_cast, cast_target, is_cast, set_tensor_dtype
from amp_compiler.passes.onnx.spec import (CONSTANT_SOURCES, cast_pair_folds, is_float_type, is_float_value,
                                     is_onnx_op, tensor_dtype)
from amp_compiler.passes.policy.numerics import FP16_MAX
from amp_compiler.passes.runner import PassResult


def fold_onnx_casts(model: ir.Model) -> PassResult:
    folder = _Folder(UniqueNames(model))
    graphs = list(model.graphs())   # folding never adds or removes a subgraph
    while folder.sweep(graphs) | folder.merge_duplicates(graphs) | folder.remove_dead(graphs):
        pass
    return PassResult(modified=sum(folder.counts.values()) > 0, counts=dict(folder.counts))


class _Folder:
    def __init__(self, names: UniqueNames):
        self.names = names
        self.counts: Counter = Counter()
        self.released: set[ir.Value] = set()   # initializers whose last reader this pass may remove

    def sweep(self, graphs: list[ir.Graph]) -> bool:
        changed = False
        for graph in graphs:
            for node in list(graph):
                if node.graph is graph and is_cast(node):
                    changed |= self.fold(node)
        return changed

    def fold(self, cast: ir.Node) -> bool:
        source, target = cast.inputs[0], cast_target(cast)
        inner = source.producer()
        if inner is not None and is_cast(inner) and \
                cast_pair_folds(tensor_dtype(inner.inputs[0]), cast_target(inner), target):
            if _only_reader(source, cast) and not cast.outputs[0].is_graph_output():
                inner.attributes["to"] = ir.AttrInt64("to", target.value)   # the model's own Cast, retargeted
                set_tensor_dtype(source, target)
                self._replace(cast, source)
                self.counts["casts_retargeted"] += 1
            else:
                cast.replace_input_with(0, inner.inputs[0])
                self.counts["cast_chains_folded"] += 1
            return True
        if tensor_dtype(source) == target:
            if bypass_cast(cast):
                self.counts["no_op_casts_removed"] += 1
                return True
            return False
        if not (is_float_value(source) and is_float_type(target)) or cast.outputs[0].is_graph_output():
            return False
        if source.is_initializer() and source.const_value is not None:
            self.fold_initializer(cast, source, target)
            return True
        if inner is not None and is_onnx_op(inner, *CONSTANT_SOURCES):
            return self.fold_into_constant(cast, inner, target)
        return False

    def fold_initializer(self, cast: ir.Node, initializer: ir.Value, target: ir.DataType) -> None:
        converted = self._convert(initializer.const_value.numpy(), target)
        if _only_reader(initializer, cast):
            initializer.const_value = ir.Tensor(converted, name=initializer.name)
            set_tensor_dtype(initializer, target)
            replacement = initializer
        else:   # fp32 readers remain: the fp16 copy is a second initializer, named as the cast's output was
            name = _take_name(cast.outputs[0])
            replacement = ir.Value(name=name, type=ir.TensorType(target), shape=_copy(initializer.shape),
                                   const_value=ir.Tensor(converted, name=name))
            initializer.graph.register_initializer(replacement)
            self.released.add(initializer)
        self._replace(cast, replacement)
        self.counts["initializers_converted"] += 1

    def fold_into_constant(self, cast: ir.Node, source_node: ir.Node, target: ir.DataType) -> bool:
        output = source_node.outputs[0]
        if source_node.op_type == "ConstantOfShape":
            if not _only_reader(output, cast):
                return False
            fill = source_node.attributes.get("value")
            fill_array = fill.as_tensor().numpy() if fill is not None else np.zeros(1, np.float32)
            source_node.attributes["value"] = ir.AttrTensor("value", ir.Tensor(self._convert(fill_array, target)))
            set_tensor_dtype(output, target)
            replacement = output
        else:
            converted = self._convert(ir.convenience.get_const_tensor(output).numpy(), target)
            if _only_reader(output, cast):
                source_node.attributes.clear()
                source_node.attributes["value"] = ir.AttrTensor("value", ir.Tensor(converted, name=output.name))
                set_tensor_dtype(output, target)
                replacement = output
            else:   # fp32 readers remain: a second Constant holds the converted values
                name = _take_name(cast.outputs[0])
                copy = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.Tensor(converted, name=name))],
                               name=self.names.node(name),
                               outputs=[ir.Value(name=name, type=ir.TensorType(target), shape=_copy(output.shape))])
                source_node.graph.insert_after(source_node, copy)
                replacement = copy.outputs[0]
        self._replace(cast, replacement)
        self.counts["constants_converted"] += 1
        return True

    def merge_duplicates(self, graphs: list[ir.Graph]) -> bool:
        changed = False
        for graph in graphs:
            first: dict[tuple[ir.Value, ir.DataType], ir.Node] = {}
            for node in list(graph):
                if not is_cast(node):
                    continue
                key = (node.inputs[0], cast_target(node))
                if key in first and not node.outputs[0].is_graph_output():
                    self._replace(node, first[key].outputs[0])
                    self.counts["duplicate_casts_merged"] += 1
                    changed = True
                else:
                    first.setdefault(key, node)
        return changed

    def remove_dead(self, graphs: list[ir.Graph]) -> bool:
        changed = False
        for graph in graphs:
            for node in reversed(list(graph)):
                if is_cast(node) and not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
                    source = node.inputs[0]
                    graph.remove(node, safe=True)
                    self.counts["dead_casts_removed"] += 1
                    changed = True
                    if source is not None and source.is_initializer():
                        self.released.add(source)
        for initializer in list(self.released):
            if not initializer.uses() and not initializer.is_graph_output() and not initializer.is_graph_input():
                initializer.graph.initializers.pop(initializer.name)
                self.released.discard(initializer)
                self.counts["unused_initializers_removed"] += 1
                changed = True
        return changed

    def _replace(self, cast: ir.Node, replacement: ir.Value) -> None:
        cast.outputs[0].replace_all_uses_with(replacement)
        cast.graph.remove(cast, safe=True)

    def _convert(self, array: np.ndarray, target: ir.DataType) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):   # overflow is counted below, not warned about
            converted = array.astype(target.numpy())
            # Only fp16 is narrower than fp32's range; check cheaply before counting.
            if target == ir.DataType.FLOAT16 and array.size and max(abs(array.max()), abs(array.min())) > FP16_MAX:
                overflowed = np.isfinite(array) & ~np.isfinite(converted)
                self.counts["constant_values_overflowed"] += int(np.count_nonzero(overflowed))
        return converted


def _take_name(value: ir.Value) -> str:
    """The name of a value about to disappear, for the value that replaces it."""
    name, value.name = value.name, None
    return name


def _only_reader(value: ir.Value, cast: ir.Node) -> bool:
    return all(use.node is cast for use in value.uses()) and not value.is_graph_output() and \
        not value.is_graph_input()


def _copy(shape):
    return shape.copy() if shape is not None else None
