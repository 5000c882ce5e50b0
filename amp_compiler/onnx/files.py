"""Read and write ONNX files for the fp16 passes, with errors that name the file.

    load_onnx_model("m.onnx")      ->  onnx_ir.Model (external weights stay on disk until a pass reads them)
    load_onnx_model(model_proto)   ->  onnx_ir.Model (a copy: the proto is not changed)
    save_onnx_model(model, "o.onnx")  ->  o.onnx, plus o.onnx.data when weights are external or the model
                                          would pass protobuf's 2 GB limit

Writes are atomic: everything is written into a temporary folder beside the destination, then renamed
over it (the data file first, then the model), so a conversion killed mid-write leaves the previous
output whole, never a 0-byte or truncated file. A destination that cannot be written (a folder, a
read-only folder, a path under a file) is an UnwritableDestinationError naming it, raised before any work.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import onnx
import onnx_ir as ir

from amp_compiler.passes.onnx.spec import is_float_type

# Protobuf cannot serialise 2 GiB; stay well below so graph and attributes fit beside the weights.
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000
EXTERNAL_TENSOR_MIN_BYTES = 1024   # small tensors stay inline: shapes, scalars, axes


class NotOnnxError(ValueError):
    """The file is missing or does not hold an ONNX model."""


class UnwritableDestinationError(OSError):
    """The destination cannot be written; the message is one line that names it."""

    def __str__(self) -> str:
        return self.args[0]


def load_onnx_model(source) -> ir.Model:
    """A path, an onnx.ModelProto (deserialized: the proto stays as it is) or an onnx_ir.Model (returned
    as it is: the passes edit it in place, as onnx-ir passes do)."""
    if isinstance(source, ir.Model):
        return source
    if isinstance(source, onnx.ModelProto):
        _require_model_fields(source.ir_version, source.opset_import, "the ModelProto")
        return ir.serde.deserialize_model(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a path, an onnx.ModelProto or an onnx_ir.Model, got {type(source).__name__}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such ONNX file")
    try:
        model = ir.load(path)
    except Exception as error:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning-turned errors...
        raise NotOnnxError(f"{path} is not an ONNX model ({type(error).__name__}: {error})") from error
    _require_model_fields(model.ir_version, model.opset_imports, path)
    return model


def _require_model_fields(ir_version: int, opset_imports, where: str) -> None:
    # Protobuf decodes an empty file, and a file cut at a field boundary, without complaint; every ONNX
    # model since IR 3 has an ir_version and an opset_import, which come before and after the graph.
    if not ir_version or not opset_imports:
        missing = "ir_version" if not ir_version else "opset_import"
        raise NotOnnxError(f"{where} is not an ONNX model (empty or truncated: no {missing})")


def has_float_tensors(model: ir.Model) -> bool:
    """Whether there is anything to convert: an fp32/fp16/bf16 tensor anywhere, bare or inside a sequence
    or optional, in any graph (Loop/If/Scan bodies included). Untyped values do not count: call it again
    after type inference before concluding there is nothing."""
    for graph in model.graphs():
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        values += [v for node in graph for v in node.outputs]
        if any(v.type is not None and is_float_type(v.type.dtype) for v in values):
            return True
    return False


def weight_bytes(model: ir.Model) -> int:
    """Bytes of all initializers, subgraphs included."""
    return sum(v.const_value.nbytes for graph in model.graphs()
               for v in graph.initializers.values() if v.const_value is not None)


def check_writable(path) -> str:
    """The destination as a string, after making its folder; UnwritableDestinationError when it cannot be
    written (root ignores permission bits, so the real test is creating a file there)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UnwritableDestinationError(f"{path}: cannot write the model there: it is a directory")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UnwritableDestinationError(f"{path}: cannot write the model there: "
                                         f"{error.strerror or error} ({folder})") from None
    return path


def save_onnx_model(model: ir.Model, path, *, external_data: bool | None = None, callback=None) -> None:
    """Write `model` atomically; external_data=None decides: external when the source was, or when the
    weights are too big for one protobuf message. `callback(tensor, info)` follows external tensors as
    they are written (onnx_ir's save callback), for progress bars."""
    path = check_writable(path)
    if external_data is None:
        external_data = has_external_tensors(model) or weight_bytes(model) > EXTERNAL_DATA_THRESHOLD_BYTES
    if not external_data:
        _load_external_tensors(model)
    with _staging_folder(path) as staging:
        staged = os.path.join(staging, os.path.basename(path))
        data_name = os.path.basename(path) + ".data"
        if external_data:
            ir.save(model, staged, external_data=data_name, size_threshold_bytes=EXTERNAL_TENSOR_MIN_BYTES,
                    callback=callback)
            os.replace(os.path.join(staging, data_name), os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                      data_name))
        else:
            ir.save(model, staged)
        os.replace(staged, path)


def copy_onnx_file(source, path) -> None:
    """`source`'s bytes (and its .data file, if it has one beside it) at `path`, atomically."""
    source, path = os.fspath(source), check_writable(path)
    if os.path.exists(path) and os.path.samefile(source, path):
        return
    with _staging_folder(path) as staging:
        staged = os.path.join(staging, os.path.basename(path))
        shutil.copyfile(source, staged)
        os.replace(staged, path)


class _staging_folder:
    """A temporary folder beside `path` (same file system, so os.replace is an atomic rename), removed
    with whatever is left in it."""

    def __init__(self, path: str):
        self.folder = os.path.dirname(os.path.abspath(path))

    def __enter__(self) -> str:
        try:
            self.staging = tempfile.mkdtemp(prefix=".amp-compiler-", dir=self.folder)
        except OSError as error:
            raise UnwritableDestinationError(f"{self.folder}: cannot write there: {error.strerror}") from None
        return self.staging

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _tensors(model: ir.Model):
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value


def has_external_tensors(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in _tensors(model))


def _load_external_tensors(model: ir.Model) -> None:
    for value in _tensors(model):
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
