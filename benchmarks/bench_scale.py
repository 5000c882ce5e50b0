"""The compiler's own cost against graph size: convert() on the torch.export path (HF Llama, tiny widths,
4..32 layers) and convert_onnx on a synthetic chain (2,500..20,000 nodes). One subprocess per row, so the
peak memory (ru_maxrss) is that row's alone. Prints one table per front end; "per node" columns should stay
flat when the cost is linear.

    python benchmarks/bench_scale.py [--layers 4,8,16,32] [--onnx-nodes 2500,5000,10000,20000]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llama(layers: int):
    import torch
    from models.torchvision_ops import import_torchvision
    import_torchvision()   # transformers imports torchvision, whose C ops the CPU build lacks
    import transformers
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), (torch.randint(0, 128, (2, 16)),)


def timed_fx_pipeline(seconds: dict):
    """FX_PIPELINE with every pass timed into `seconds` (by pass name)."""
    import importlib
    convert_module = importlib.import_module("amp_compiler.convert_model")
    pipelines = importlib.import_module("amp_compiler.passes.pipelines")
    pipeline = pipelines.FX_PIPELINE

    def timed(step):
        def run(state):
            start = time.perf_counter()
            try:
                return step.run(state)
            finally:
                seconds[step.name] += time.perf_counter() - start
        return dataclasses.replace(step, run=run)

    pipelines.FX_PIPELINE = dataclasses.replace(pipeline, passes=tuple(timed(p) for p in pipeline.passes))
    trace = convert_module.capture

    def timed_trace(*args, **kwargs):   # the front end (torch.export here): not our passes
        start = time.perf_counter()
        try:
            return trace(*args, **kwargs)
        finally:
            seconds["(trace)"] += time.perf_counter() - start

    convert_module.capture = timed_trace


def child_llama(layers: int) -> dict:
    import torch
    import amp_compiler
    warnings.filterwarnings("ignore")
    model, inputs = llama(layers)
    seconds: dict = defaultdict(float)
    timed_fx_pipeline(seconds)
    base = _peak_mb()
    start = time.perf_counter()
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    total = time.perf_counter() - start
    assert gm.meta["amp"]["frontend"] == "torch.export", gm.meta["amp"]["frontend"]
    trace_s = seconds.pop("(trace)")
    slowest = max(seconds, key=seconds.get)
    return {"size": layers, "nodes": len(gm.graph.nodes), "seconds": total, "trace": trace_s,
            "passes": sum(seconds.values()),
            "slowest": f"{slowest} {seconds[slowest]:.2f}", "peak_mb": _peak_mb(), "base_mb": base}


def chain_model(nodes: int, path: str) -> int:
    """MatMul -> Add -> Relu -> Mul by a constant, repeated: `nodes` nodes, a 16x16 weight per block."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    graph_nodes, inits, value = [], [], "x"
    inits.append(numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"))
    for i in range(nodes // 4):
        w, b = f"w{i}", f"b{i}"
        inits += [numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), w),
                  numpy_helper.from_array(np.zeros(16, dtype=np.float32), b)]
        graph_nodes += [helper.make_node("MatMul", [value, w], [f"m{i}"]), helper.make_node("Add", [f"m{i}", b], [f"a{i}"]),
                        helper.make_node("Relu", [f"a{i}"], [f"r{i}"]), helper.make_node("Mul", [f"r{i}", "half"], [f"y{i}"])]
        value = f"y{i}"
    graph = helper.make_graph(graph_nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info(value, TensorProto.FLOAT, [2, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return len(graph_nodes)


def child_onnx(nodes: int) -> dict:
    import amp_compiler
    with tempfile.TemporaryDirectory() as directory:
        source, target = os.path.join(directory, "chain.onnx"), os.path.join(directory, "chain_fp16.onnx")
        count = chain_model(nodes, source)
        base = _peak_mb()
        start = time.perf_counter()
        report = amp_compiler.convert_onnx(source, target, "O1")
        total = time.perf_counter() - start
    return {"size": count, "nodes": count, "seconds": total, "trace": 0.0, "passes": total,
            "slowest": f"casts {report.casts}",
            "peak_mb": _peak_mb(), "base_mb": base}


def run_child(kind: str, size: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(size)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        return {"size": size, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(title: str, rows: list[dict]) -> None:
    from bench_convert import table
    body, previous = [], None
    for r in rows:
        if "error" in r:
            body.append([r["size"], "FAILED", r["error"], "", "", "", "", "", ""])
            continue
        growth = f"{r['seconds'] / previous['seconds']:.2f}x/{r['nodes'] / previous['nodes']:.2f}x" if previous else "-"
        body.append([r["size"], r["nodes"], f"{r['seconds']:.2f}", f"{r['trace']:.2f}", f"{r['passes']:.2f}",
                     f"{r['seconds'] / r['nodes'] * 1e3:.2f}", growth, r["slowest"],
                     f"{r['peak_mb']:.0f} (+{r['peak_mb'] - r['base_mb']:.0f})"])
        previous = r
    table(title, ["size", "nodes", "total s", "trace s", "passes s", "ms/node", "time/nodes growth", "slowest pass s",
                  "peak MB (+during)"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,16,32")
    parser.add_argument("--onnx-nodes", default="2500,5000,10000,20000")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, size = args.child
        print(json.dumps((child_llama if kind == "llama" else child_onnx)(int(size))))
        return
    llama_rows = [run_child("llama", int(n)) for n in args.layers.split(",") if n]
    print_table("convert(), HF Llama (hidden 32, torch.export front end), O1 bf16; size = layers", llama_rows)
    onnx_rows = [run_child("onnx", int(n)) for n in args.onnx_nodes.split(",") if n]
    print_table("convert_onnx, synthetic MatMul/Add/Relu/Mul chain, O1 fp16; size = nodes", onnx_rows)


if __name__ == "__main__":
    main()
