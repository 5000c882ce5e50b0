"""Type the values of an ONNX model with ONNX's own inference, never by patching value_info by hand.

    fill_missing (source model):   values without a type  ->  typed by onnx.shape_inference (subgraph
                                    outputs too: a function body's If branches declare none); records each
                                    graph's declared output shapes
    verify_rewrite (after rewrite): every node output's type is erased and inferred again; inference must
                                    agree with the dtypes the rewrite meant, or the pass raises; graph outputs
                                    get their recorded shapes back (a re-conversion changes no declaration)

One serialization and one onnx.shape_inference call per run; only the inferred value_info is read back
(by name, graph by graph), not the whole inferred model. Main-graph initializers above 1 KB reach onnx as
graph inputs without data (their dtype and shape are all inference needs), so models over 2 GB are inferred
without hitting protobuf's limit. Graph inputs and outputs are declarations and keep their types (an output
without a shape gains the inferred one: onnx.checker's full check asks for it).
A source model that ONNX's strict inference rejects at a node the rewrite did not touch (a function body
with an attribute-less Constant, MeanVarianceNormalization) is not refused: the rewrite is verified with
non-strict inference, and the node named is counted in "source_fails_strict_inference". Outputs of ops that onnx
has no schema for (custom domains) keep the type the rewrite gave them; they are counted in
"values_typed_without_schema".
"""
from __future__ import annotations

import re

import onnx
import onnx_ir as ir

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.spec import subgraphs_of, tensor_dtype
from amp_compiler.passes.runner import PassResult

INLINE_TENSOR_MAX_BYTES = 1024   # shape inputs (Reshape, Expand...) stay inline: data propagation reads them
DECLARED_OUTPUT_SHAPES = "declared_output_shapes"   # graph.meta: the source's output shapes, by index
_FLOAT_ELEMENT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_NAMED_NODE = re.compile(r"node name: ([^)]*)\)")


def infer_onnx_types(model: ir.Model, *, verify_rewrite: bool) -> PassResult:
    if not verify_rewrite:
        return _fill_missing(model)
    _restore_declared_output_shapes(model)
    meant = {v: (v.dtype, v.shape) for v in _node_outputs(model, lambda v: isinstance(v.type, ir.TensorType))}
    for value in meant:
        value.type, value.shape = None, None
    counts = {}
    try:
        try:
            inferred = _inferred_types(model, strict=True)
        except Exception as error:  # noqa: BLE001 - onnx raises InferenceError, ValidationError...
            blamed = _untouched_nodes_named(model, str(error))
            if not blamed:
                raise
            counts["source_fails_strict_inference"] = len(blamed)
            inferred = _inferred_types(model, strict=False)
        _apply(model, inferred, meant)
    except Exception as error:  # noqa: BLE001
        for value, (dtype, shape) in meant.items():
            value.dtype, value.shape = dtype, shape
        raise RuntimeError(f"ONNX type inference failed on the rewritten model: {str(error).strip()}") from error
    untyped = [v for v in meant if v.type is None]
    if meant and len(untyped) == len(meant):
        raise RuntimeError("ONNX type inference failed on the rewritten model: inference typed nothing")
    wrong = [f"{v.name}: inferred {v.dtype.name}, rewrite meant {dtype.name}"
             for v, (dtype, _) in meant.items() if v.type is not None and v.dtype != dtype]
    if wrong:
        raise RuntimeError("the fp16 rewrite and ONNX type inference disagree on " + "; ".join(wrong[:10]))
    for value in untyped:
        value.dtype = meant[value][0]
    for value, (_, shape) in meant.items():
        if value.shape is None:
            value.shape = shape
    return PassResult(modified=True, counts={"values_typed_without_schema": len(untyped), **counts})


def infers_float_values(model: ir.Model) -> bool:
    """Whether ONNX inference finds an fp32/fp16/bf16 value (bare, in a sequence or an optional) anywhere in
    `model`, without typing anything: what decides there is nothing to convert."""
    try:
        inferred = _inferred_types(model, strict=False)
    except Exception:  # noqa: BLE001 - a model inference cannot read has no inferred floats
        return False
    return any(_holds_float(t) for types in inferred for t in types.values())


def _holds_float(type_proto: onnx.TypeProto) -> bool:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return type_proto.tensor_type.elem_type in _FLOAT_ELEMENT_TYPES
    if kind in ("sequence_type", "optional_type"):
        return _holds_float(getattr(type_proto, kind).elem_type)
    return False


def _fill_missing(model: ir.Model) -> PassResult:
    untyped = _node_outputs(model, lambda v: v.type is None)
    untyped += [v for graph in model.graphs() for v in graph.outputs if v.type is None and v not in untyped]
    if untyped:
        try:
            _apply(model, _inferred_types(model, strict=False), untyped)
        except Exception:  # noqa: BLE001 - what inference cannot type, painting leaves alone
            pass
    for graph in model.graphs():   # after filling: an output that declared no shape keeps the inferred one
        graph.meta[DECLARED_OUTPUT_SHAPES] = tuple(v.shape for v in graph.outputs)
    return PassResult(modified=bool(untyped), counts={"values_typed": sum(v.type is not None for v in untyped)})


def _restore_declared_output_shapes(model: ir.Model) -> None:
    """A graph output's shape is a declaration: the rewrite changes dtypes only, so the source's shape
    holds, whichever value now carries the output (a stripped Cast hands the name to its input)."""
    for graph in model.graphs():
        declared = graph.meta.get(DECLARED_OUTPUT_SHAPES)
        if declared is None or len(declared) != len(graph.outputs):
            continue
        for value, shape in zip(graph.outputs, declared):
            if shape is not None:
                value.shape = shape.copy()


def _untouched_nodes_named(model: ir.Model, message: str) -> list[str]:
    """The nodes a strict-inference error names, when the rewrite left every one of them as the source had
    it (same input dtypes, not painted low, no Cast the rewrite added); else [] (the rewrite is to blame)."""
    named = set(_NAMED_NODE.findall(message))
    if not named:
        return []
    by_name = {node.name: node for graph in model.graphs() for node in graph}
    if not named <= by_name.keys():
        return []
    for name in named:
        node = by_name[name]
        if _touched(node) or any(_touched(n) for sub in subgraphs_of(node) for n in all_nodes(sub)):
            return []
    return sorted(named)


def _touched(node: ir.Node) -> bool:
    source = node.meta.get("source_input_dtypes")
    if source is None:   # a node the rewrite added
        return True
    return tuple(tensor_dtype(v) for v in node.inputs) != source or facts(node).get("precision") == "low"


def _node_outputs(model: ir.Model, keep) -> list[ir.Value]:
    """Values produced by nodes that are not graph outputs (those are declarations), in every graph."""
    found = []
    for graph in model.graphs():
        for node in graph:
            found.extend(v for v in node.outputs if not v.is_graph_output() and keep(v))
    return found


def _inferred_types(model: ir.Model, *, strict: bool) -> list[dict[str, onnx.TypeProto]]:
    """Name -> inferred TypeProto (value_info and graph outputs), one dict per graph in Model.graphs() order."""
    inferred = onnx.shape_inference.infer_shapes(_inference_proto(model), check_type=strict, strict_mode=strict,
                                                 data_prop=True)
    return [{info.name: info.type for info in (*graph.value_info, *graph.output)}
            for graph in graph_protos(inferred.graph)]


def _apply(model: ir.Model, inferred: list[dict[str, onnx.TypeProto]], values) -> None:
    """Type `values` as inferred, each looked up in the graph that owns it; graph outputs keep their declared
    type and only gain a shape they did not declare (onnx.checker's full check wants one)."""
    wanted = set(values)
    for graph, types in zip(model.graphs(), inferred, strict=True):
        for node in graph:
            for value in node.outputs:
                if value in wanted and value.name in types:
                    value.type = ir.serde.deserialize_type_proto_for_type(types[value.name])
                    value.shape = ir.serde.deserialize_type_proto_for_shape(types[value.name])
        for value in graph.outputs:
            if value.shape is None and value.name in types:
                value.shape = ir.serde.deserialize_type_proto_for_shape(types[value.name])


def graph_protos(graph: onnx.GraphProto):
    """`graph` and its subgraphs in Model.graphs() order (a node's attributes in order, depth first)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from graph_protos(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from graph_protos(subgraph)


def _inference_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as onnx inference needs it: main-graph initializers above 1 KB are declared as graph inputs
    without data (their dtype and shape are all it reads), as onnx_ir's ShapeInferencePass does."""
    large = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and tensor.nbytes > INLINE_TENSOR_MAX_BYTES:
            large[value.name] = (value, tensor)
            value.const_value = ir.ExternalTensor("amp-compiler-inference-only", 0, tensor.nbytes, tensor.dtype,
                                                  shape=tensor.shape, name=value.name, base_dir="")
    try:
        proto = ir.to_proto(model)   # the large tensors are written as references: no bytes copied
    finally:
        for value, tensor in large.values():
            value.const_value = tensor
    graph = proto.graph
    declared = {info.name for info in graph.input}
    for index in reversed(range(len(graph.initializer))):
        tensor = graph.initializer[index]
        if tensor.name in large:
            if tensor.name not in declared:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
            del graph.initializer[index]
    return proto
