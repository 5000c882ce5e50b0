"""Where convert_onnx spends its time: onnx-ir load, each pass (type inference is infer_types:fill and
infer_types:verify), save; on the zoo (fp32 torch.onnx exports) and on a large synthetic model, with
onnxconverter-common's convert_float_to_float16 (load + convert + save) alongside. Best of --repeats.

    python benchmarks/profile_onnx.py [--size small|full] [--models mlp bert] [--large-mb 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from amp_compiler import make_config  # noqa: E402
from amp_compiler.onnx.convert import run_onnx_pipeline  # noqa: E402
from amp_compiler.onnx.export import export_fp32_reference  # noqa: E402
from amp_compiler.onnx.files import load_onnx_model, save_onnx_model  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

GROUPS = {"load": ("load",), "type inference": ("infer_types:fill", "infer_types:verify"),
          "decide": ("canonicalize", "decide_precision", "store_moved_weights_low"),
          "rewrite": ("unique_names", "sort", "strip_float_casts", "insert_casts", "fold_casts", "lower_graph_inputs",
                      "declare_initializer_inputs", "sort:after_rewrite"),
          "save": ("save",)}


def profile_once(src: str, dst: str, level: str) -> dict[str, float]:
    """Seconds per step of one conversion (the steps convert_onnx takes, timed one by one)."""
    seconds, marks = {}, []
    started = time.perf_counter()
    model = load_onnx_model(src)
    seconds["load"] = time.perf_counter() - started

    def on_pass(name: str) -> None:
        marks.append((name, time.perf_counter()))

    run_onnx_pipeline(model, make_config(level), on_pass=on_pass)
    ended = time.perf_counter()
    for (name, start), (_, end) in zip(marks, [*marks[1:], ("", ended)]):
        seconds[name] = end - start
    started = time.perf_counter()
    save_onnx_model(model, dst)
    seconds["save"] = time.perf_counter() - started
    seconds["total"] = sum(seconds.values())
    return seconds


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    fastest = min(runs, key=lambda r: r["total"])
    return fastest


def onnxconverter_common_seconds(src: str, dst: str, repeats: int) -> float:
    from onnxconverter_common import float16
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = float16.convert_float_to_float16(onnx.load(src), keep_io_types=True)
        onnx.save(converted, dst)
        times.append(time.perf_counter() - started)
    return min(times)


def large_model(path: str, megabytes: int) -> None:
    """A stack of Linear+LayerNorm+GELU blocks of 2048x2048 fp32 weights (16 MB each) up to `megabytes`."""
    width, rng = 2048, np.random.default_rng(0)
    blocks = max(1, megabytes * 2**20 // (width * width * 4))
    nodes, inits, x = [], [], "x"
    for i in range(blocks):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width), np.float32) * 0.02), f"w{i}"),
                  numpy_helper.from_array(np.ones(width, np.float32), f"g{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"matmul{i}"),
                  helper.make_node("LayerNormalization", [f"h{i}", f"g{i}", f"b{i}"], [f"n{i}"], name=f"norm{i}"),
                  helper.make_node("Gelu", [f"n{i}"], [f"y{i}"], name=f"gelu{i}")]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, width])],
                              [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [8, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    save_onnx_model(ir.serde.deserialize_model(model), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--models", nargs="*", default=list(ZOO_NAMES), choices=ZOO_NAMES)
    parser.add_argument("--large-mb", type=int, default=128, help="size of the synthetic model (0: none)")
    parser.add_argument("--level", default="O1")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as folder:
        sources = []
        for name in args.models:
            task = build(name, size=args.size)
            path = os.path.join(folder, f"{name}.onnx")
            export_fp32_reference(task.model, task.example_inputs, path)
            sources.append((name, path))
        if args.large_mb:
            path = os.path.join(folder, "large.onnx")
            large_model(path, args.large_mb)
            sources.append((f"synthetic {args.large_mb} MB", path))
        for name, src in sources:
            dst = os.path.join(folder, "out.onnx")
            profile = best([profile_once(src, dst, args.level) for _ in range(args.repeats)])
            grouped = {g: sum(profile.get(step, 0.0) for step in steps) for g, steps in GROUPS.items()}
            slowest = max((s for s in profile if s not in ("total",)), key=profile.get)
            rows.append((name, os.path.getsize(src) / 1e6, grouped, profile["total"], slowest, profile[slowest],
                         onnxconverter_common_seconds(src, os.path.join(folder, "oc.onnx"), args.repeats)))
            profiles[name] = profile
    print(f"convert_onnx at {args.level}, zoo size {args.size}: milliseconds, best of {args.repeats} "
          "(load + passes + save; type inference = infer_types:fill + :verify)")
    header = f"{'model':<18} {'MB':>7} " + " ".join(f"{g:>14}" for g in GROUPS) + \
        f" {'total':>9} {'slowest step':>24} {'oc total':>9}"
    print(header)
    for name, megabytes, grouped, total, slowest, slowest_s, oc in rows:
        print(f"{name:<18} {megabytes:>7.2f} " + " ".join(f"{grouped[g] * 1e3:>14.1f}" for g in GROUPS) +
              f" {total * 1e3:>9.1f} {f'{slowest} {slowest_s * 1e3:.1f}':>24} {oc * 1e3:>9.1f}")
    if profiles:
        name = max(profiles, key=lambda n: profiles[n]["total"])
        steps = profiles[name]
        print(f"\nsteps of the slowest conversion ({name}), milliseconds:")
        for step, seconds in steps.items():
            print(f"  {step:<28} {seconds * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
