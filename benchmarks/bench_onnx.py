"""fp16 ONNX conversion, side by side in one run: our convert_onnx against onnxconverter-common's
convert_float_to_float16, whose op_block_list is set to the ONNX op types our rules keep in fp32.

For every zoo model: an fp32 ONNX export (torch.onnx, dynamo), then both converters file to file:
Cast nodes, weight bytes, conversion time (best of --repeats, load + convert + save), output error
against the fp32 model in ONNX Runtime, ONNX Runtime CPU latency (median of --runs), and whether
onnx.checker (full_check) accepts the file. The CPU provider runs most fp16 ops in fp32, so latency
and error here measure casts and weight traffic, not fp16 arithmetic. Sessions use one intra-op
thread: with two, ORT's CPU scatter kernels (GAT's edge softmax) give run-to-run differences of ~1e-2
even on the fp32 model, which would swamp the fp16 error.

    python benchmarks/bench_onnx.py [--size full] [--level O1] [--repeats 5] [--runs 50] [--models bert gpt]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from amp_compiler import convert_onnx, make_config  # noqa: E402
from amp_compiler.onnx.export import export_fp32_reference  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402
from amp_compiler.passes.onnx.canonicalize import all_nodes, onnx_canonicalize  # noqa: E402


def make_session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def fp32_op_types(path: str, level: str) -> list[str]:
    """The model's ONNX op types whose canonical op the rules deny at `level` (what we keep in fp32)."""
    model = ir.load(path)
    onnx_canonicalize(model)
    rules = make_config(level).precision_rules()
    return sorted({n.op_type for n in all_nodes(model.graph) if rules.classify(n.meta["amp"]["op"])[0] == "deny"})


def convert_ours(src: str, dst: str, level: str) -> None:
    convert_onnx(src, dst, level)


def convert_onnxconverter_common(src: str, dst: str, block_list: list[str]) -> None:
    from onnxconverter_common import float16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # it warns about every value it clamps to [1e-7, 1e4]
        converted = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True, op_block_list=block_list)
    onnx.save(converted, dst)


def measure(convert, src: str, dst: str, reference: list, feeds: dict, repeats: int, runs: int) -> dict:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        convert(src, dst)
        seconds.append(time.perf_counter() - started)
    model = onnx.load(dst)
    row = {"casts": sum(n.op_type == "Cast" for n in _all_onnx_nodes(model.graph)),
           "weights": sum(t.ByteSize() for t in model.graph.initializer), "seconds": min(seconds)}
    row["failures"] = []
    try:
        onnx.checker.check_model(dst, full_check=True)
        row["valid"] = "yes"
    except Exception as error:  # noqa: BLE001 - the table reports what went wrong
        row["valid"] = "no"
        row["failures"].append(f"checker: {_first_line(error)}")
    try:
        session = make_session(dst)
        outputs = session.run(None, feeds)
        row["error"] = max(_relative_error(o, r) for o, r in zip(outputs, reference))
        row["latency"] = _latency(session, feeds, runs)
    except Exception as error:  # noqa: BLE001
        row["error"], row["latency"] = float("nan"), "fails"
        row["failures"].append(f"onnxruntime: {_first_line(error)}")
    return row


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:200]


def _relative_error(output, reference) -> float:
    output, reference = np.asarray(output, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(output - reference).max() / max(np.abs(reference).max(), 1e-6))


def _latency(session, feeds: dict, runs: int) -> float:
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _all_onnx_nodes(graph):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs):
                yield from _all_onnx_nodes(sub)


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=("small", "full"))
    parser.add_argument("--level", default="O1")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=ZOO_NAMES, choices=ZOO_NAMES)
    args = parser.parse_args()
    header = ["model", "converter", "casts", "weight KB", "convert ms", "rel. error", "ORT CPU ms", "checker"]
    rows, block_lists, failures = [], {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            task = build(name, size=args.size)
            fp32 = os.path.join(scratch, f"{name}.onnx")
            export_fp32_reference(task.model, task.example_inputs, fp32)
            reference_session = make_session(fp32)
            feeds = {i.name: x.numpy() for i, x in zip(reference_session.get_inputs(), task.example_inputs)}
            reference = reference_session.run(None, feeds)
            block_lists[name] = fp32_op_types(fp32, args.level)
            source = {"casts": sum(n.op_type == "Cast" for n in _all_onnx_nodes(onnx.load(fp32).graph)),
                      "weights": sum(t.ByteSize() for t in onnx.load(fp32).graph.initializer), "seconds": 0.0,
                      "error": 0.0, "latency": _latency(reference_session, feeds, args.runs), "valid": "yes"}
            candidates = {
                "fp32 source": {**source, "failures": []},
                "amp-compiler": measure(lambda s, d: convert_ours(s, d, args.level), fp32,
                                        os.path.join(scratch, f"{name}_ours.onnx"), reference, feeds,
                                        args.repeats, args.runs),
                "onnxconverter-common": measure(
                    lambda s, d: convert_onnxconverter_common(s, d, block_lists[name]), fp32,
                    os.path.join(scratch, f"{name}_oc.onnx"), reference, feeds, args.repeats, args.runs),
            }
            for converter, r in candidates.items():
                failures += [f"{name} / {converter}: {f}" for f in r["failures"]]
                latency = r["latency"] if isinstance(r["latency"], str) else f"{1e3 * r['latency']:.3f}"
                rows.append([name, converter, r["casts"], f"{r['weights'] / 1024:.1f}", f"{1e3 * r['seconds']:.1f}",
                             f"{r['error']:.2e}", latency, r["valid"]])
    print(f"fp16 ONNX conversion at {args.level}, zoo size {args.size}, keep_io_types=True, "
          f"ONNX Runtime CPU (latency: median of {args.runs} runs; convert: best of {args.repeats})\n")
    table(header, rows)
    print("\nonnxconverter-common op_block_list (the op types our rules keep fp32 in each model):")
    for name, ops in block_lists.items():
        print(f"  {name}: {', '.join(ops) or '(none)'}")
    if failures:
        print("\nfailures:")
        for failure in failures:
            print(f"  {failure}")


if __name__ == "__main__":
    main()
