"""Decide a precision for every ONNX node with the fx side's rules and painting, on a view of the ONNX graph.

    node.meta["amp"] += {class, family, reason, precision: "low"|"fp32"|None, rule, forced}

The view has one vertex per node that computes on fp32/fp16/bf16 tensors, keyed by node name, and an edge
per float data value from producer to reader. A value read inside an If branch links its outer producer
to the reading node; an If node reads its branches' outputs, so a branch and the code after the If paint
together. Loop/Scan bodies are painted op by op, their loop-carried values keep their dtype.
Forced fp32, before painting, strongest first: nodes that cannot run in the low dtype (the op's ONNX
schema has no such type, or ONNX Runtime refuses it), op_block_list (ONNX op types), node_block_list
(node names), the user's force_fp32/force_low patterns on node names and torch module paths, and nodes
that read a constant the low dtype cannot hold (an initializer, Constant or ConstantOfShape fill beyond
fp16's 65504 or bf16's 3.39e38, such as finfo(float32).min), directly or through reshapes and other data
movement.
Reads meta["amp"]["op"] and ["module"] (onnx_canonicalize) and the value types in the model.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnx
import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.spec import (input_role, is_float_value, is_onnx_op, low_precision_blocker,
                                     subgraphs_of)
from amp_compiler.passes.painting.decide import decide
from amp_compiler.passes.painting.paint_precision import PAINTABLE
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.policy.names import check_known_names
from amp_compiler.passes.policy.numerics import low_max, short_name
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.passes.node_facts import facts


class OnnxNodes:
    """The ONNX side of the decide step (passes/painting/decide.py)."""

    def __init__(self, model: ir.Model, rules: PrecisionRules, low: ir.DataType, op_block_list=(), node_block_list=()):
        self.model, self.rules, self.low = model, rules, low
        self.all = list(all_nodes(model.graph))
        missing = sorted(set(node_block_list) - {n.name for n in self.all})
        if missing:
            raise ValueError(f"node_block_list names {missing}, which are not nodes of this model")
        check_known_names("op_block_list", sorted(op_block_list), known_op_types() | {n.op_type for n in self.all},
                          kind="ONNX op types (nor op types of this model's custom domains)",
                          hint="op types are case-sensitive: Softmax, LayerNormalization")
        self.op_block_list, self.node_block_list = set(op_block_list), set(node_block_list)
        self.blocked: dict[ir.Node, str] = {}
        self.out_of_range: dict[ir.Node, str] = {}

    def nodes(self) -> list[ir.Node]:
        return self.all

    def name(self, node: ir.Node) -> str:
        return node.name

    def meta(self, node: ir.Node) -> dict:
        return facts(node)

    def fixed_class(self, node: ir.Node) -> None:
        return None

    def set_aside(self, node: ir.Node, op_class: str) -> tuple[None, str] | None:
        if not _computes_on_floats(node):
            return None, "no fp32/fp16/bf16 operand (int, bool or fp64): untouched"
        if _has_untyped_tensor(node):
            return None, "type inference cannot type its inputs/outputs: untouched"
        return None

    def classified(self) -> None:
        self.blocked = _block_lists(self.all, self.op_block_list, self.node_block_list)
        opset = self.model.opset_imports.get("", 1)
        for node in self.all:
            # deny ops are fp32 anyway: their report keeps the policy's reason
            why = low_precision_blocker(node, self.low, opset) \
                if facts(node)["class"] in ("allow", "infer", "clear") else None
            if why:
                self.blocked[node] = why + ": kept fp32"
        self.out_of_range = _readers_of_out_of_range_constants(self.model, self.rules.low_dtype)

    def forced(self, node: ir.Node, rules: PrecisionRules) -> tuple[str, str] | None:
        # Precedence: what cannot run low and the call's block lists, the user's patterns, the range guard.
        by_pattern = rules.forced(facts(node)["module"], node.name)
        if node in self.blocked:
            return "fp32", self.blocked[node]
        if by_pattern is not None:
            return by_pattern
        return ("fp32", self.out_of_range[node]) if node in self.out_of_range else None

    def edges(self):
        for node in self.all:
            if facts(node)["class"] not in PAINTABLE:
                continue
            for value in _data_inputs(node):
                producer = value.producer()
                if producer is not None:
                    yield producer.name, node.name

    def record(self, node: ir.Node, amp: dict, painted: dict | None, rules: PrecisionRules) -> None:
        if painted is not None:
            amp["forced"] = painted["forced"] is not None   # later passes never overturn a forced precision


def decide_onnx_precision(model: ir.Model, rules: PrecisionRules, low: ir.DataType, *, op_block_list=(),
                          node_block_list=(), painted=()) -> PassResult:
    """`painted`: hooks that see the painted view before the precisions are written back."""
    counts = decide(OnnxNodes(model, rules, low, op_block_list, node_block_list), rules, painted)
    return PassResult(modified=False, counts=counts)


@lru_cache(maxsize=1)
def known_op_types() -> frozenset[str]:
    """Every op type onnx has a schema for, in any domain and opset (ai.onnx, ai.onnx.ml, preview...)."""
    return frozenset(schema.name for schema in onnx.defs.get_all_schemas_with_history())


def _data_inputs(node: ir.Node) -> list[ir.Value]:
    """The float values whose precision follows the node's: data inputs, or an If's branch outputs."""
    if is_onnx_op(node, "If"):
        return [v for branch in subgraphs_of(node) for v in branch.outputs if is_float_value(v)]
    return [v for i, v in enumerate(node.inputs) if is_float_value(v) and input_role(node, i) == "data"]


def _computes_on_floats(node: ir.Node) -> bool:
    return any(is_float_value(v) for v in (*node.inputs, *node.outputs))


def _has_untyped_tensor(node: ir.Node) -> bool:
    return any(v is not None and v.type is None for v in (*node.inputs, *node.outputs))


def _block_lists(nodes: list[ir.Node], op_types: set, names: set) -> dict[ir.Node, str]:
    forced = {}
    for node in nodes:
        if node.name in names:
            forced[node] = f"node_block_list: {node.name}"
        elif node.op_type in op_types:
            forced[node] = f"op_block_list: {node.op_type}"
    return forced


def _readers_of_out_of_range_constants(model: ir.Model, low_dtype: str) -> dict[ir.Node, str]:
    """Nodes that read (directly or through data movement) a constant the low dtype cannot hold: they stay
    fp32 rather than see inf. Nothing is clipped: the values stay exact."""
    limit, short = low_max(low_dtype), short_name(low_dtype)
    forced: dict[ir.Node, str] = {}
    for value, peak in _out_of_range_constants(model, limit):
        why = f"reads {value.name}, which holds |x| up to {peak:.6g} > {limit:.5g} ({short} max): kept fp32"
        stack = [value]
        while stack:
            for reader in stack.pop().consumers():
                if reader in forced:
                    continue
                forced[reader] = why
                if facts(reader).get("class") == "clear":   # moves values unchanged: follow them
                    stack.extend(v for v in reader.outputs if is_float_value(v))
    return forced


def _out_of_range_constants(model: ir.Model, limit: float):
    for graph in model.graphs():
        candidates = [v for v in graph.initializers.values() if is_float_value(v) and v.const_value is not None]
        candidates += [n.outputs[0] for n in graph if is_onnx_op(n, "Constant", "ConstantOfShape")
                       and is_float_value(n.outputs[0])]
        for value in candidates:
            tensor = _constant_tensor(value)
            if tensor is None or tensor.size == 0:
                continue
            peak = _finite_peak(tensor.numpy())
            if peak > limit:
                yield value, peak


def _constant_tensor(value: ir.Value):
    producer = value.producer()
    if producer is not None and is_onnx_op(producer, "ConstantOfShape"):
        fill = producer.attributes.get("value")
        return fill.as_tensor() if fill is not None else None
    return ir.convenience.get_const_tensor(value)


def _finite_peak(array: np.ndarray) -> float:
    """max |x| over the finite values; two reductions, no copy, unless the tensor holds inf or nan."""
    peak = max(abs(float(array.max())), abs(float(array.min())))
    if np.isfinite(peak):
        return peak
    finite = np.abs(array[np.isfinite(array)])
    return float(finite.max()) if finite.size else 0.0
