"""Type the values of an ONNX model with ONNX's own inference, never by patching value_info by hand.

    fill_missing (source model):   values without a type  ->  typed by onnx.shape_inference
    verify_rewrite (after rewrite): every node output's type is erased and inferred again; inference must
                                    agree with the dtypes the rewrite meant, or the pass raises

One serialization and one onnx.shape_inference call per run; only the inferred value_info is read back
(by name, graph by graph), not the whole inferred model. Main-graph initializers above 1 KB reach onnx as
graph inputs without data (their dtype and shape are all inference needs), so models over 2 GB are inferred
without hitting protobuf's limit. Graph inputs and outputs are declarations and keep their types (an output
without a shape gains the inferred one: onnx.checker's full check asks for it). Outputs of ops that onnx
has no schema for (custom domains) keep the type the rewrite gave them; they are counted in
"values_typed_without_schema".
"""
from __future__ import annotations

import onnx
import onnx_ir as ir

from amp_compiler.passes.runner import PassResult

INLINE_TENSOR_MAX_BYTES = 1024   # shape inputs (Reshape, Expand...) stay inline: data propagation reads them


def infer_onnx_types(model: ir.Model, *, verify_rewrite: bool) -> PassResult:
    if not verify_rewrite:
        untyped = _node_outputs(model, lambda v: v.type is None)
        if untyped:
            try:
                _apply(model, _inferred_types(model, strict=False), untyped)
            except Exception:  # noqa: BLE001 - what inference cannot type, painting leaves alone
                pass
        return PassResult(modified=bool(untyped),
                          counts={"values_typed": sum(v.type is not None for v in untyped)})
    meant = {v: (v.dtype, v.shape) for v in _node_outputs(model, lambda v: isinstance(v.type, ir.TensorType))}
    for value in meant:
        value.type, value.shape = None, None
    try:
        _apply(model, _inferred_types(model, strict=True), meant)
    except Exception as error:  # noqa: BLE001 - onnx raises InferenceError, ValidationError...
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
    return PassResult(modified=True, counts={"values_typed_without_schema": len(untyped)})


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
