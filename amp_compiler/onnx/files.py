"""Read and write ONNX files for the fp16 passes, with errors that name the file.

    load_onnx_model("m.onnx")      ->  onnx_ir.Model (external weights stay on disk until a pass reads them)
    save_onnx_model(model, "o.onnx")  ->  o.onnx, plus o.onnx.data when weights are external or the model
                                          would pass protobuf's 2 GB limit
"""
from __future__ import annotations

import os

import onnx_ir as ir

from amp_compiler.passes.onnx.spec import is_float_value

# Protobuf cannot serialise 2 GiB; stay well below so graph and attributes fit beside the weights.
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000
EXTERNAL_TENSOR_MIN_BYTES = 1024   # small tensors stay inline: shapes, scalars, axes


class NotOnnxError(ValueError):
    """The file is missing or does not hold an ONNX model."""


def load_onnx_model(path) -> ir.Model:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such ONNX file")
    try:
        return ir.load(path)
    except Exception as error:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning-turned errors...
        raise NotOnnxError(f"{path} is not an ONNX model ({type(error).__name__}: {error})") from error


def require_float_tensors(model: ir.Model, path) -> None:
    """A conversion needs something to convert: at least one fp32/fp16/bf16 tensor."""
    for graph in model.graphs():
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        values += [v for node in graph for v in node.outputs]
        if any(is_float_value(v) for v in values):
            return
    raise ValueError(f"{os.fspath(path)} has no float32/float16/bfloat16 tensors: nothing to convert")


def weight_bytes(model: ir.Model) -> int:
    """Bytes of all initializers, subgraphs included."""
    return sum(v.const_value.nbytes for graph in model.graphs()
               for v in graph.initializers.values() if v.const_value is not None)


def save_onnx_model(model: ir.Model, path, *, external_data: bool | None = None) -> None:
    """Write `model`; external_data=None decides: external when the source was, or when the weights are
    too big for one protobuf message."""
    path = os.fspath(path)
    if external_data is None:
        external_data = _has_external_tensors(model) or weight_bytes(model) > EXTERNAL_DATA_THRESHOLD_BYTES
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not external_data:
        _load_external_tensors(model)
        ir.save(model, path)
        return
    data_name = os.path.basename(path) + ".data"
    if _reads_from(model, os.path.join(os.path.dirname(os.path.abspath(path)), data_name)):
        _load_external_tensors(model)   # about to overwrite the file these tensors still read from
    ir.save(model, path, external_data=data_name, size_threshold_bytes=EXTERNAL_TENSOR_MIN_BYTES)


def _tensors(model: ir.Model):
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value


def _has_external_tensors(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in _tensors(model))


def _reads_from(model: ir.Model, data_path: str) -> bool:
    if not os.path.exists(data_path):
        return False
    return any(isinstance(v.const_value, ir.ExternalTensor) and os.path.exists(v.const_value.path) and
               os.path.samefile(v.const_value.path, data_path) for v in _tensors(model))


def _load_external_tensors(model: ir.Model) -> None:
    for value in _tensors(model):
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
