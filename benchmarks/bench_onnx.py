"""fp16 ONNX, side by side in one run: our export_onnx (model -> fp16 ONNX) and convert_onnx (fp32 ONNX ->
fp16 ONNX) against the peers' float16 converters: onnxconverter-common's convert_float_to_float16 and, when
importable, onnxruntime.transformers' copy of it, each with op_block_list set to the ONNX op types our rules
keep fp32 in that model.

For every model: an fp32 ONNX export (torch.onnx, dynamo) is the source of the converters and the reference;
export_onnx starts from the PyTorch model. Per row: Cast nodes, weight bytes, time (converters: best of
--repeats, load + convert + save; export_onnx: one call, torch.onnx.export included, next to the fp32
export's own time on the source row), output error against the fp32 model in ONNX Runtime, ONNX Runtime CPU
latency (median of --runs), and whether onnx.checker (full_check) accepts the file. The CPU provider runs
most fp16 ops in fp32, so latency and error here measure casts and weight traffic, not fp16 arithmetic.
Sessions use one intra-op thread (ORT's CPU scatter kernels give run-to-run differences otherwise).

Models: the real architectures of issue 9 (torchvision ResNet-18 / MobileNetV3-small, tiny HF BERT / GPT-2,
an nn.TransformerEncoder; random init, tests/real_models.py; torchvision and transformers come with [dev]),
or any zoo model (models/).

    python benchmarks/bench_onnx.py [--models tv_resnet18 hf_gpt2_sdpa bert] [--level O1] [--repeats 3] [--runs 50]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import models.torchvision_ops  # noqa: E402,F401  (torchvision's missing op schemas, before anything imports it)

from amp_compiler import convert_onnx, export_onnx, make_config  # noqa: E402
from amp_compiler.onnx.export import export_fp32_reference  # noqa: E402
from amp_compiler.passes.onnx.canonicalize import all_nodes, onnx_canonicalize  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

REAL_NAMES = ("tv_resnet18", "tv_mobilenet_v3", "hf_bert_sdpa", "hf_gpt2_sdpa", "nn_transformer_encoder")


def make_session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def load_model(name: str, size: str):
    """(fp32 model in eval mode, positional example inputs) of a real model or a zoo model."""
    if name in ZOO_NAMES:
        task = build(name, size=size)
        return task.model.eval(), tuple(task.example_inputs)
    from real_models import REAL_MODELS
    spec = REAL_MODELS[name]
    inputs = []
    for value in spec.inputs():
        if value is None:     # an ONNX graph has no optional-input slots
            break
        inputs.append(value)
    return spec.build(), tuple(inputs)


def fp32_op_types(path: str, level: str) -> list[str]:
    """The model's ONNX op types whose canonical op the rules deny at `level` (what we keep in fp32)."""
    model = ir.load(path)
    onnx_canonicalize(model)
    rules = make_config(level).precision_rules()
    return sorted({n.op_type for n in all_nodes(model.graph) if rules.classify(n.meta["amp"]["op"])[0] == "deny"})


def onnxconverter_common_converter():
    from onnxconverter_common import float16
    return float16.convert_float_to_float16


def onnxruntime_converter():
    from onnxruntime.transformers import float16
    return float16.convert_float_to_float16


PEERS = {"onnxconverter-common": onnxconverter_common_converter, "onnxruntime float16": onnxruntime_converter}


def convert_with_peer(converter, src: str, dst: str, block_list: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # both warn about every value they clamp to [1e-7, 1e4]
        converted = converter(onnx.load(src), keep_io_types=True, op_block_list=block_list)
    onnx.save(converted, dst)


def timed(convert, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        convert()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def measure(path: str, seconds: float, reference: list, feeds: dict, runs: int) -> dict:
    model = onnx.load(path)
    row = {"casts": sum(n.op_type == "Cast" for n in _all_onnx_nodes(model.graph)),
           "weights": sum(t.ByteSize() for t in model.graph.initializer), "seconds": seconds, "failures": []}
    try:
        onnx.checker.check_model(path, full_check=True)
        row["valid"] = "yes"
    except Exception as error:  # noqa: BLE001 - the table reports what went wrong
        row["valid"] = "no"
        row["failures"].append(f"checker: {_first_line(error)}")
    try:
        session = make_session(path)
        outputs = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
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
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
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


def bench_model(name: str, args, scratch: str) -> tuple[dict, list[str]]:
    model, inputs = load_model(name, args.size)
    fp32 = os.path.join(scratch, f"{name}.onnx")
    started = time.perf_counter()
    export_fp32_reference(model, inputs, fp32)
    export_seconds = time.perf_counter() - started
    reference_session = make_session(fp32)
    feeds = {i.name: x.numpy() for i, x in zip(reference_session.get_inputs(), inputs)}
    reference = reference_session.run(None, feeds)
    block_list = fp32_op_types(fp32, args.level)
    candidates = {"fp32 source": measure(fp32, export_seconds, reference, feeds, args.runs)}
    candidates["fp32 source"]["error"] = 0.0

    exported = os.path.join(scratch, f"{name}_export.onnx")
    started = time.perf_counter()
    export_onnx(model, inputs, exported, args.level)
    candidates["export_onnx"] = measure(exported, time.perf_counter() - started, reference, feeds, args.runs)

    converted = os.path.join(scratch, f"{name}_convert.onnx")
    seconds = timed(lambda: convert_onnx(fp32, converted, args.level), args.repeats)
    candidates["convert_onnx"] = measure(converted, seconds, reference, feeds, args.runs)

    for peer, load_converter in PEERS.items():
        try:
            converter = load_converter()
        except ImportError:
            continue
        path = os.path.join(scratch, f"{name}_{peer.split()[0]}.onnx")
        try:
            seconds = timed(lambda: convert_with_peer(converter, fp32, path, block_list), args.repeats)
        except Exception as error:  # noqa: BLE001 - a peer that refuses the model is a row, not a crash
            candidates[peer] = {"casts": "-", "weights": 0, "seconds": float("nan"), "error": float("nan"),
                                "latency": "fails", "valid": "-", "failures": [f"convert: {_first_line(error)}"]}
            continue
        candidates[peer] = measure(path, seconds, reference, feeds, args.runs)
    return candidates, block_list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(REAL_NAMES), metavar="NAME",
                        help=f"real models ({', '.join(REAL_NAMES)}) or zoo models ({', '.join(ZOO_NAMES)})")
    parser.add_argument("--size", default="full", choices=("small", "full"), help="zoo model size")
    parser.add_argument("--level", default="O1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    header = ["model", "converter", "casts", "weight KB", "time ms", "rel. error", "ORT CPU ms", "checker"]
    rows, block_lists, failures = [], {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            candidates, block_lists[name] = bench_model(name, args, scratch)
            for converter, r in candidates.items():
                failures += [f"{name} / {converter}: {f}" for f in r["failures"]]
                latency = r["latency"] if isinstance(r["latency"], str) else f"{1e3 * r['latency']:.3f}"
                rows.append([name, converter, r["casts"], f"{r['weights'] / 1024:.1f}", f"{1e3 * r['seconds']:.1f}",
                             f"{r['error']:.2e}", latency, r["valid"]])
    print(f"fp16 ONNX at {args.level}, keep_io_types=True, ONNX Runtime CPU (latency: median of {args.runs} runs; "
          f"converters: best of {args.repeats}; time of the fp32 source and of export_onnx: one torch.onnx export)\n")
    table(header, rows)
    print("\npeers' op_block_list (the op types our rules keep fp32 in each model's fp32 export):")
    for name, ops in block_lists.items():
        print(f"  {name}: {', '.join(ops) or '(none)'}")
    if failures:
        print("\nfailures:")
        for failure in failures:
            print(f"  {failure}")


if __name__ == "__main__":
    main()
