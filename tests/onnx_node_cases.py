"""The ONNX backend node tests as convert_onnx test material, generated from the installed onnx package's
case generators (onnx.backend.test.case.node: every registered expect() case), not from a data folder.

    float_cases()                 ->  {name: TestCase} whose model reads or returns float32 (sequences too)
    check_conversion(case, level, folder)   raises AssertionError naming the failed check, else returns
                                            what it checked

The checks, per case and level: convert_onnx succeeds; onnx.checker (full_check) accepts the result when
it accepts the source; ONNX Runtime (CPU) loads and runs it; float outputs are within fp16 tolerance of
the expected ones (ONNX Runtime's fp32 result where that differs from onnx's reference), int/bool outputs
exact, dtypes as the source's; converting the result again changes no byte; every fp16 initializer holds
exactly its source values rounded to fp16 (nothing clipped). with_weights() turns a case's float inputs
into initializers, so that the last check has weights to look at (the node tests have none).
"""
from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from amp_compiler import convert_onnx

FP16_MAX = float(np.finfo(np.float16).max)
ORT_MAX_IR_VERSION = 13   # onnxruntime 1.31
RTOL = ATOL = 1e-2   # fp16 keeps ~3 decimal digits; a few roundings per op stay below 1e-2


@functools.cache
def all_cases() -> dict:
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {case.name: case for case in collect_testcases()}


def float_cases() -> dict:
    return {name: case for name, case in all_cases().items() if _reads_or_returns_fp32(case.model)}


def _reads_or_returns_fp32(model: onnx.ModelProto) -> bool:
    return any(_holds_fp32(v.type) for v in (*model.graph.input, *model.graph.output))


def _holds_fp32(type_proto: onnx.TypeProto) -> bool:
    """A float32 tensor, or a sequence / optional of one."""
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return type_proto.tensor_type.elem_type == onnx.TensorProto.FLOAT
    return kind in ("sequence_type", "optional_type") and _holds_fp32(getattr(type_proto, kind).elem_type)


def cases_by_op_type(cases: dict) -> dict[str, list[str]]:
    """{op type: its single-node cases, in the suite's order}; a test takes the first that ONNX Runtime runs."""
    grouped: dict[str, list[str]] = {}
    for name, case in cases.items():
        nodes = case.model.graph.node
        if len(nodes) == 1:
            op = nodes[0].op_type if not nodes[0].domain else f"{nodes[0].domain}.{nodes[0].op_type}"
            grouped.setdefault(op, []).append(name)
    return grouped


def source_model(case) -> onnx.ModelProto:
    """The case's model, stamped with at most the IR version ONNX Runtime reads (the generators stamp the
    newest, 14, on cases of old opsets)."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    return model


def session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level, options.intra_op_num_threads = 4, 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def feeds_of(case, sess: ort.InferenceSession, inputs=None) -> dict:
    values = case.data_sets[0][0] if inputs is None else inputs
    return {i.name: (v if isinstance(v, list) else np.asarray(v)) for i, v in zip(sess.get_inputs(), values)}


def with_weights(case):
    """The case's model with its float32 inputs as initializers holding the test's values (the other inputs
    stay inputs); returns (model, remaining input values)."""
    model = source_model(case)
    graph, values = model.graph, case.data_sets[0][0]
    present = [i for i in graph.input]
    kept_inputs, kept_values = [], []
    for info, value in zip(present, values):
        if info.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and isinstance(value, np.ndarray):
            graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), info.name))
            if model.ir_version < 4:
                kept_inputs.append(info)
        else:
            kept_inputs.append(info)
            kept_values.append(value)
    del graph.input[:]
    graph.input.extend(kept_inputs)
    return model, kept_values


class SourceNotRunnable(Exception):
    """ONNX Runtime cannot run the source model itself: nothing to compare with."""


def reference(source_path: str, case, inputs=None):
    """ONNX Runtime's fp32 outputs (None for an output that differs between two runs: random ops), the
    feeds, and the expected outputs to compare with."""
    try:
        sess = session(source_path)
        feeds = feeds_of(case, sess, inputs)
        first, second = sess.run(None, feeds), sess.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - ORT's own limits (missing kernels, unsupported types)
        raise SourceNotRunnable(f"{case.name}: ONNX Runtime cannot run the fp32 source: {error}") from None
    stable = [a if not isinstance(a, list) and _same(a, b) else None for a, b in zip(first, second)]
    return stable, feeds


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


def check_conversion(case, level: str, folder, *, weights: bool = False) -> dict:
    model, inputs = with_weights(case) if weights else (source_model(case), None)
    src = os.path.join(folder, "src.onnx")
    dst, again = os.path.join(folder, f"{level}.onnx"), os.path.join(folder, f"{level}_again.onnx")
    onnx.save(model, src)
    expected, feeds = reference(src, case, inputs)
    report = convert_onnx(src, dst, level)
    source_valid = _checker_accepts(src)
    if source_valid:
        onnx.checker.check_model(dst, full_check=True)
    got = session(dst).run(None, feeds)
    compared = _compare_outputs(case.name, got, expected)
    convert_onnx(dst, again, level)
    with open(dst, "rb") as a, open(again, "rb") as b:
        assert a.read() == b.read(), f"{case.name} {level}: converting the converted model changed it"
    exact_weights = _assert_nothing_clipped(case.name, model, onnx.load(dst))
    return {"report": report, "outputs_compared": compared, "checker": source_valid, "weights_checked": exact_weights}


def _checker_accepts(path: str) -> bool:
    try:
        onnx.checker.check_model(path, full_check=True)
        return True
    except Exception:  # noqa: BLE001 - a source the checker rejects (MVN's function body): nothing to keep
        return False


def _compare_outputs(name: str, got: list, expected: list) -> int:
    compared = 0
    for index, (out, ref) in enumerate(zip(got, expected)):
        if ref is None or isinstance(out, list):
            continue
        out, ref = np.asarray(out), np.asarray(ref)
        assert out.dtype == ref.dtype, f"{name} output {index}: dtype {out.dtype}, source gives {ref.dtype}"
        assert out.shape == ref.shape, f"{name} output {index}: shape {out.shape}, source gives {ref.shape}"
        if ref.dtype.kind == "f":
            in_range = ~(np.abs(ref) > FP16_MAX)   # beyond fp16: inf is the honest answer
            close = np.isclose(out.astype(np.float64), ref.astype(np.float64), rtol=RTOL, atol=ATOL, equal_nan=True)
            worst = np.nanmax(np.abs(out.astype(np.float64) - ref), initial=0, where=in_range & ~close)
            assert (close | ~in_range).all(), f"{name} output {index}: off by up to {worst:.4g} (fp16 tolerance {RTOL})"
        else:
            assert np.array_equal(out, ref), f"{name} output {index}: {ref.dtype} values differ (must be exact)"
        compared += 1
    return compared


def _assert_nothing_clipped(name: str, source: onnx.ModelProto, converted: onnx.ModelProto) -> int:
    """Every fp16 initializer is its source initializer (same name, or name_float16) rounded to fp16."""
    originals = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer
                 if t.data_type == onnx.TensorProto.FLOAT}
    checked = 0
    for tensor in converted.graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT16:
            continue
        original = originals.get(tensor.name, originals.get(tensor.name.removesuffix("_float16")))
        if original is None:
            continue
        stored = numpy_helper.to_array(tensor)
        with np.errstate(over="ignore"):
            rounded = original.astype(np.float16)
        assert np.array_equal(stored, rounded, equal_nan=True), f"{name}: initializer {tensor.name} was clipped"
        assert np.isfinite(stored[np.isfinite(original)]).all(), f"{name}: {tensor.name} holds values fp16 cannot"
        checked += 1
    return checked
