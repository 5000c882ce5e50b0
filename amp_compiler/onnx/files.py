"""Read and write ONNX files for the fp16 passes, with errors that name the file.

    load_onnx_model("m.onnx")      ->  onnx_ir.Model (external weights stay on disk until a pass reads them)
    load_onnx_model(model_proto)   ->  onnx_ir.Model (a copy: the proto is not changed)
    save_onnx_model(model, "o.onnx")  ->  o.onnx, plus o.onnx.data when weights are external or the model
                                          would pass protobuf's 2 GB limit

Writes are atomic: everything is written into a staging file (or, with external data, a staging folder)
beside the destination, then renamed over it (the data file first, then the model), so a conversion
killed mid-write leaves the previous output whole, never a 0-byte or truncated file. A destination that
cannot be written (a folder, a read-only folder, a path under a file) is an UnwritableDestinationError
naming it, raised before any work.

Permissions are those `open(path, "w")` gives: an existing destination keeps its mode, a new one gets
0o666 less the umask (and the folder's default ACL), since the staging file is created the same way.

Staging names: `.<destination name>.amp-compiler.<host>.<pid>.<8 hex>.tmp` (a file) or `.staging` (a
folder), in the destination's folder. A run killed mid-write leaves its staging file there; the next
write to the same destination removes those that are stale: written on this host by a process that no
longer exists and untouched for DEAD_WRITER_QUIET_SECONDS (containers sharing a host name and a volume do
not see each other's processes), or (any host) untouched for STALE_STAGING_SECONDS. A live writer's staging
file (another process converting to the same path right now) is never removed.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import stat
import time

import onnx
import onnx_ir as ir

from amp_compiler.passes.onnx.spec import is_float_type

# Protobuf cannot serialise 2 GiB; stay well below so graph and attributes fit beside the weights.
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000
EXTERNAL_TENSOR_MIN_BYTES = 1024   # small tensors stay inline: shapes, scalars, axes
# A staging file whose writer we cannot see (another host, or a pid reused since) is stale once it has not
# been written to for this long: a live writer touches it continuously until the rename.
STALE_STAGING_SECONDS = 24 * 3600
# A writer's pid gone from this host is not proof enough: another PID namespace with the same host name may
# be writing it. A file that has also been quiet this long is not being written.
DEAD_WRITER_QUIET_SECONDS = 10 * 60
STAGING_MARK = "amp-compiler"


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
    written. os.access says no for read-only folders and file systems; where it cannot tell (root ignores
    permission bits), creating the temporary file is the last check."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UnwritableDestinationError(f"{path}: cannot write the model there: it is a directory")
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UnwritableDestinationError(f"{path}: cannot write the model there: a file stands where a folder "
                                         "of this path should be") from None
    except OSError as error:
        raise UnwritableDestinationError(f"{path}: cannot write the model there: {error.strerror} ({folder})") \
            from None
    if not os.access(folder, os.W_OK):
        raise UnwritableDestinationError(f"{path}: cannot write the model there: permission denied ({folder})")
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
        with _staged_file(path) as staged:
            ir.save(model, staged)
        return
    # The model names its data file, so both are staged under their final names in a folder of their own.
    folder, data_name = os.path.dirname(os.path.abspath(path)), os.path.basename(path) + ".data"
    remove_stale_staging(path)
    staging = _make_staging(path, "staging")
    try:
        staged = os.path.join(staging, os.path.basename(path))
        ir.save(model, staged, external_data=data_name, size_threshold_bytes=EXTERNAL_TENSOR_MIN_BYTES,
                callback=callback)
        data_path = os.path.join(folder, data_name)
        _keep_existing_mode(os.path.join(staging, data_name), data_path)
        _keep_existing_mode(staged, path)
        os.replace(os.path.join(staging, data_name), data_path)
        os.replace(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_onnx_file(source, path) -> None:
    """`source`'s bytes at `path`, atomically (for a model without external data)."""
    source, path = os.fspath(source), check_writable(path)
    if os.path.exists(path) and os.path.samefile(source, path):
        return
    with _staged_file(path) as staged:
        shutil.copyfile(source, staged)


@contextlib.contextmanager
def _staged_file(path: str):
    """A staging file beside `path` (same file system: os.replace is an atomic rename) that becomes
    `path` when the block ends without error, and is removed when it does not."""
    remove_stale_staging(path)
    staged = _make_staging(path, "tmp")
    try:
        yield staged
        _keep_existing_mode(staged, path)
        os.replace(staged, path)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


def _make_staging(path: str, kind: str) -> str:
    """A new staging file (kind "tmp") or folder ("staging") for `path`. The file is created with mode
    0o666 as open() creates files, so the umask and the folder's default ACL apply to it."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        name = f"{_staging_prefix(path)}{_host()}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"
        staged = os.path.join(folder, name)
        try:
            if kind == "staging":
                os.mkdir(staged, 0o700)
            else:
                os.close(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return staged
        except FileExistsError:
            continue
        except OSError as error:
            raise UnwritableDestinationError(f"{path}: cannot write the model there: {error.strerror} "
                                             f"({folder})") from None


def _keep_existing_mode(staged: str, path: str) -> None:
    # open(path, "w") on an existing file keeps its mode; the rename would replace it with the new file's.
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    os.chmod(staged, mode)


def remove_stale_staging(path) -> list[str]:
    """Remove the staging files and folders a killed write to `path` left beside it (see the module
    docstring for which count as stale); returns the paths removed. Others' files it cannot remove stay."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(_staging_prefix(path)) +
                         r"(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(tmp|staging)")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        staged = os.path.join(folder, name)
        if match is None or not _is_stale(staged, match["host"], int(match["pid"])):
            continue
        try:
            if os.path.isdir(staged) and not os.path.islink(staged):
                shutil.rmtree(staged)
            else:
                os.remove(staged)
        except OSError:
            continue
        removed.append(staged)
    return removed


def _staging_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.{STAGING_MARK}."


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _is_stale(staged: str, host: str, pid: int) -> bool:
    try:
        entries = [staged, *(os.path.join(staged, n) for n in os.listdir(staged))] if os.path.isdir(staged) \
            else [staged]
        last_written = max(os.lstat(entry).st_mtime for entry in entries)
    except OSError:
        return False   # removed meanwhile, or not ours to read
    quiet = time.time() - last_written
    if host == _host() and quiet > DEAD_WRITER_QUIET_SECONDS and not _process_exists(pid):
        return True
    return quiet > STALE_STAGING_SECONDS


def _process_exists(pid: int) -> bool:
    if os.name != "posix":
        return True   # os.kill(pid, 0) would end the process on Windows: the age rule decides there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # another user's live process
    except OSError:
        return True   # cannot tell: keep the file
    return True


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
