"""convert_onnx's files and inputs (issue 9): atomic writes, ModelProto / onnx_ir.Model sources and returned
models, one-line errors for unwritable destinations and unknown op types, IR-3 models."""
import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from amp_compiler import convert_onnx
from amp_compiler.cli import main as cli_main
from amp_compiler.onnx import files
from onnx_testing import F16, F32, assert_valid, initializer, make_model, run, save, tensor_input

RNG = np.random.default_rng(0)


def small_model(opset: int = 18):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="gemm"),
             helper.make_node("Add", ["x", "b"], ["xb"], name="add_bias"),
             helper.make_node("Softmax", ["xb"], ["s"], name="softmax"),
             helper.make_node("Add", ["h", "s"], ["y"], name="sum")]
    inits = [initializer("w", RNG.standard_normal((4, 4)).astype(np.float32)),
             initializer("b", RNG.standard_normal(4).astype(np.float32))]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])], inits, opset=opset)


def fail_while_writing(monkeypatch):
    """Make onnx_ir's save write half a file, then die (a conversion killed mid-write)."""
    def half_written_save(model, path, *args, **kwargs):
        with open(path, "wb") as file:
            file.write(b"\x08\x0a")
        external = kwargs.get("external_data")
        if external:
            with open(os.path.join(os.path.dirname(path), external), "wb") as file:
                file.write(b"\x00" * 3)
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(files.ir, "save", half_written_save)


@pytest.mark.parametrize("external", [False, True])
def test_a_write_killed_midway_leaves_the_previous_output_whole(tmp_path, monkeypatch, external):
    if external:
        monkeypatch.setattr(files, "EXTERNAL_DATA_THRESHOLD_BYTES", 10)
        monkeypatch.setattr(files, "EXTERNAL_TENSOR_MIN_BYTES", 16)
    src, dst = save(small_model(), tmp_path, "src.onnx"), tmp_path / "out.onnx"
    convert_onnx(src, str(dst))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out.onnx")}
    assert ("out.onnx.data" in before) == external
    fail_while_writing(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        convert_onnx(src, str(dst), "O3")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "src.onnx"}
    assert after == before, "the previous output must be untouched and no temporary file left behind"
    monkeypatch.undo()
    assert_valid(str(dst))


@contextlib.contextmanager
def umask(mask):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def write_modes(tmp_path, monkeypatch, how):
    """Convert (or copy, or write with external data) to a new and to an existing destination; their modes."""
    src = save(small_model(), tmp_path, "src.onnx")
    if how == "external":
        monkeypatch.setattr(files, "EXTERNAL_DATA_THRESHOLD_BYTES", 10)
        monkeypatch.setattr(files, "EXTERNAL_TENSOR_MIN_BYTES", 16)
    level = "O0" if how == "copied" else "O1"      # O0 copies the source byte for byte
    new, existing = tmp_path / "new.onnx", tmp_path / "existing.onnx"
    existing.write_bytes(b"old")
    existing.chmod(0o640)
    for dst in (new, existing):
        convert_onnx(src, str(dst), level)
    written = [new, existing] + ([tmp_path / "new.onnx.data"] if how == "external" else [])
    return [stat.S_IMODE(path.stat().st_mode) for path in written]


@pytest.mark.parametrize("how", ["converted", "copied", "external"])
@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask 022", "umask 077"])
def test_written_files_get_the_mode_open_would_give(tmp_path, monkeypatch, mask, how):
    """A new file: 0o666 less the umask (a serving process of another user may read it under 0o022); an
    existing one keeps its mode, as open(path, "w") keeps it."""
    with umask(mask):
        modes = write_modes(tmp_path, monkeypatch, how)
    assert modes[:2] == [0o666 & ~mask, 0o640]
    assert modes[2:] in ([], [0o666 & ~mask])


def staging_name(destination, pid, host=None, kind="tmp", salt="0123abcd"):
    """A staging name as files.py makes them: .<name>.amp-compiler.<host>.<pid>.<8 hex>.<tmp|staging>."""
    return f".{destination}.amp-compiler.{host or files._host()}.{pid}.{salt}.{kind}"


def finished_process_id():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("external", [False, True])
def test_stale_staging_files_for_the_destination_are_removed_by_the_next_write(tmp_path, monkeypatch, external):
    if external:
        monkeypatch.setattr(files, "EXTERNAL_DATA_THRESHOLD_BYTES", 10)
        monkeypatch.setattr(files, "EXTERNAL_TENSOR_MIN_BYTES", 16)
    src, dead = save(small_model(), tmp_path, "src.onnx"), finished_process_id()
    long_ago = time.time() - files.STALE_STAGING_SECONDS - 60
    stale = [tmp_path / staging_name("out.onnx", dead),                      # killed on this host
             tmp_path / staging_name("out.onnx", os.getpid(), host="elsewhere")]   # another host, untouched
    stale_folder = tmp_path / staging_name("out.onnx", dead, kind="staging")     # a killed external write
    kept = [tmp_path / staging_name("out.onnx", os.getpid()),               # a live writer: this process
            tmp_path / staging_name("out.onnx", dead, host="elsewhere"),    # another host, recent
            tmp_path / staging_name("other.onnx", dead),                    # another destination
            tmp_path / f".out.onnx.{dead}.tmp"]                              # not our name
    for path in stale + kept:
        path.write_bytes(b"\x08" * 100)
    stale_folder.mkdir()
    (stale_folder / "out.onnx.data").write_bytes(b"\x00" * 100)
    quiet = time.time() - files.DEAD_WRITER_QUIET_SECONDS - 60
    os.utime(stale[1], (long_ago, long_ago))
    for path in (stale[0], stale_folder / "out.onnx.data", stale_folder):
        os.utime(path, (quiet, quiet))
    # written just now by a pid this host does not see: another PID namespace's writer, maybe; kept
    kept.append(tmp_path / staging_name("out.onnx", dead, salt="00decade"))
    kept[-1].write_bytes(b"\x08" * 100)
    convert_onnx(src, str(tmp_path / "out.onnx"))
    assert [p.name for p in stale + [stale_folder] if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []
    assert_valid(str(tmp_path / "out.onnx"))


@pytest.mark.slow
def test_a_killed_write_leaves_its_staging_file_where_the_docstring_says(tmp_path):
    """What the cleanup must recognise: the name a real killed write leaves (SIGKILL, no finally runs)."""
    src = save(small_model(), tmp_path, "src.onnx")
    script = ("import os, signal, sys; from amp_compiler import convert_onnx; from amp_compiler.onnx import files\n"
              "files.ir.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
              "convert_onnx(sys.argv[1], sys.argv[2])")
    child = subprocess.Popen([sys.executable, "-c", script, src, str(tmp_path / "out.onnx")])
    assert child.wait(timeout=300) == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir() if p.name != "src.onnx"]
    assert len(left) == 1 and re.fullmatch(rf"\.out\.onnx\.amp-compiler\.{files._host()}\.{child.pid}\.[0-9a-f]{{8}}\.tmp",
                                           left[0]), left
    convert_onnx(src, str(tmp_path / "out.onnx"))   # just killed: too recent to be sure its writer is gone
    assert len(list(tmp_path.iterdir())) == 3
    quiet = time.time() - files.DEAD_WRITER_QUIET_SECONDS - 60
    os.utime(tmp_path / left[0], (quiet, quiet))
    convert_onnx(src, str(tmp_path / "out.onnx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "src.onnx"]


def test_a_model_proto_in_and_out_without_files(tmp_path):
    model = small_model()
    original = model.SerializeToString()
    report = convert_onnx(model, None, "O1")
    assert isinstance(report.model, onnx.ModelProto) and report.destination == "(returned)"
    assert model.SerializeToString() == original, "the caller's proto is not changed"
    stored = {t.name: t.data_type for t in report.model.graph.initializer}
    assert stored["w"] == F16
    onnx.checker.check_model(report.model, full_check=True)
    path = save(report.model, tmp_path, "returned.onnx")
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    (out,), (ref,) = run(path, {"x": x}), run(save(model, tmp_path, "ref.onnx"), {"x": x})
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_a_model_proto_or_onnx_ir_model_written_to_a_path_matches_a_file_source(tmp_path):
    src = save(small_model(), tmp_path, "src.onnx")
    convert_onnx(src, str(tmp_path / "from_path.onnx"))
    convert_onnx(onnx.load(src), str(tmp_path / "from_proto.onnx"))
    report = convert_onnx(ir.load(src), str(tmp_path / "from_ir.onnx"))
    assert report.source == "(an onnx_ir.Model)"
    expected = (tmp_path / "from_path.onnx").read_bytes()
    assert (tmp_path / "from_proto.onnx").read_bytes() == expected == (tmp_path / "from_ir.onnx").read_bytes()


def test_an_onnx_ir_model_is_converted_in_place_and_returned(tmp_path):
    model = ir.serde.deserialize_model(small_model())
    report = convert_onnx(model, None)
    assert report.model is model
    assert model.graph.initializers["w"].dtype == ir.DataType.FLOAT16


def test_a_source_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="onnx.ModelProto or an onnx_ir.Model, got bytes"):
        convert_onnx(small_model().SerializeToString(), None)


def unwritable_destinations(tmp_path):
    a_file = tmp_path / "plain.txt"
    a_file.write_text("not a folder")
    (tmp_path / "a_directory").mkdir()
    return [str(tmp_path / "a_directory"), str(a_file / "out.onnx")]


def test_an_unwritable_destination_is_one_line_naming_it(tmp_path):
    src = save(small_model(), tmp_path, "src.onnx")
    for dst in unwritable_destinations(tmp_path):
        with pytest.raises(OSError) as caught:
            convert_onnx(src, dst)
        message = str(caught.value)
        assert dst in message and "\n" not in message and "cannot write" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_one_line_naming_it(tmp_path):
    src = save(small_model(), tmp_path, "src.onnx")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(OSError, match="locked/out.onnx: cannot write"):
            convert_onnx(src, str(locked / "out.onnx"))
    finally:
        locked.chmod(0o755)


def test_the_cli_says_an_unwritable_destination_in_one_line(tmp_path, capsys):
    src = save(small_model(), tmp_path, "src.onnx")
    for dst in unwritable_destinations(tmp_path):
        assert cli_main(["convert-onnx", src, dst]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and dst in err and "Traceback" not in err


def test_op_block_list_entries_that_are_not_op_types_are_named(tmp_path):
    src = save(small_model(), tmp_path, "src.onnx")
    with pytest.raises(ValueError, match=r"op_block_list names \['Softmx', 'gemm'\], which are not ONNX op types"):
        convert_onnx(src, str(tmp_path / "o.onnx"), op_block_list=["Softmx", "gemm", "Gemm"])
    assert not (tmp_path / "o.onnx").exists()
    report = convert_onnx(src, str(tmp_path / "o.onnx"), op_block_list=["Gemm", "LabelEncoder"])   # ai.onnx.ml too
    assert {r["node"]: r["precision"] for r in report.rows}["gemm"] == "float32"


def ir3_model():
    """IR 3 / opset 7: every initializer is also a graph input."""
    model = small_model(opset=7)
    model.graph.input.extend([tensor_input("w", F32, [4, 4]), tensor_input("b", F32, [4])])
    model.ir_version = 3
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_ir3_model_converts_to_a_file_the_checker_accepts(tmp_path):
    src = save(ir3_model(), tmp_path, "src.onnx")
    dst, again = str(tmp_path / "ir3_fp16.onnx"), str(tmp_path / "ir3_again.onnx")
    report = convert_onnx(src, dst)
    onnx.checker.check_model(dst, full_check=True)
    converted = onnx.load(dst)
    assert converted.ir_version == 3
    assert {t.name for t in converted.graph.initializer} <= {i.name for i in converted.graph.input}
    assert report.pass_counts["declare_initializer_inputs"]["initializers_declared_as_inputs"] >= 1
    convert_onnx(dst, again)
    assert open(dst, "rb").read() == open(again, "rb").read()
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    (out,), (ref,) = run(dst, {"x": x}), run(src, {"x": x})
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_progress_is_shown_on_request_and_not_for_quick_conversions(tmp_path, capsys):
    src = save(small_model(), tmp_path, "src.onnx")
    convert_onnx(src, str(tmp_path / "quiet.onnx"))   # default: only past PROGRESS_AFTER_SECONDS, on a terminal
    assert "convert_onnx" not in capsys.readouterr().err
    convert_onnx(src, str(tmp_path / "shown.onnx"), progress=True)
    assert "convert_onnx" in capsys.readouterr().err
