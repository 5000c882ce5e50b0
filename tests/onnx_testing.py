"""Shared helpers of the ONNX tests: build small graphs with onnx.helper, check the output's invariants."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_compiler.onnx.sessions import make_session
from amp_compiler.passes.onnx.infer_types import graph_protos

OPSET = 18
F32, F16, I64, BOOL = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL


def tensor_input(name: str, elem_type: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def initializer(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def make_model(nodes, inputs, outputs, initializers=(), opset: int = OPSET, name: str = "g") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10   # what onnxruntime 1.31 reads
    return model


def save(model: onnx.ModelProto, directory, name: str) -> str:
    path = str(directory / name)
    onnx.save(model, path)
    return path


def run(path: str, feeds: dict) -> list[np.ndarray]:
    return make_session(path).run(None, feeds)


def all_nodes(model: onnx.ModelProto):
    for graph in graph_protos(model.graph):
        yield from graph.node


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in all_nodes(model) if n.op_type == op_type]


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named value (inputs, outputs, initializers, value_info), after inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {}
    for graph in graph_protos(inferred.graph):
        for info in (*graph.input, *graph.output, *graph.value_info):
            types[info.name] = info.type.tensor_type.elem_type
        for tensor in graph.initializer:
            types[tensor.name] = tensor.data_type
        for node in graph.node:
            if node.op_type == "Constant":
                for attribute in node.attribute:
                    if attribute.name == "value":
                        types[node.output[0]] = attribute.t.data_type
    return types


def input_types(model: onnx.ModelProto, node: onnx.NodeProto) -> list[int | None]:
    types = value_types(model)
    return [types.get(name) for name in node.input]


def assert_clean_casts(model: onnx.ModelProto) -> None:
    """No Cast reads a Cast, at most one Cast per (value, dtype) and graph, none to the dtype it reads,
    none reads an initializer (weights are stored converted)."""
    types = value_types(model)
    for graph in graph_protos(model.graph):
        producers = {out: node for node in graph.node for out in node.output}
        initializers = {t.name for t in graph.initializer}
        casts = [n for n in graph.node if n.op_type == "Cast"]
        for cast in casts:
            source = cast.input[0]
            assert producers.get(source) is None or producers[source].op_type != "Cast", \
                f"Cast chain: {producers[source].name} -> {cast.name}"
            assert source not in initializers, f"runtime Cast {cast.name} of initializer {source}"
            assert types.get(source) != _to(cast), f"no-op Cast {cast.name}"
        pairs = Counter((c.input[0], _to(c)) for c in casts)
        assert all(n == 1 for n in pairs.values()), f"duplicate casts: {pairs}"


def assert_sorted_and_named(model: onnx.ModelProto) -> None:
    """Every graph topologically sorted (outer values visible inside subgraphs); node names unique."""
    def check(graph, visible):
        available = set(visible) | {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
        for node in graph.node:
            for attribute in node.attribute:
                subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
                for sub in subgraphs:
                    check(sub, available)
            missing = [i for i in node.input if i not in available]
            assert not missing, f"{node.name} reads {missing} before they are produced"
            available.update(node.output)
    check(model.graph, set())
    names = [n.name for n in all_nodes(model)]
    assert all(names) and len(names) == len(set(names)), "node names must be unique and non-empty"


def assert_valid(path: str) -> None:
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    assert_clean_casts(model)
    assert_sorted_and_named(model)


def same_model(path_a: str, path_b: str) -> bool:
    return onnx.load(path_a) == onnx.load(path_b)


def _to(cast: onnx.NodeProto) -> int:
    return next(a.i for a in cast.attribute if a.name == "to")


def onnx_inputs(inputs: tuple) -> tuple:
    """Positional inputs up to the first None (an ONNX graph has no optional-input slots)."""
    kept = []
    for value in inputs:
        if value is None:
            break
        kept.append(value)
    return tuple(kept)
