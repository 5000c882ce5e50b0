"""Every conformance model (tests/real_models.py) converted in place on TorchDynamo's capture, bf16 O1: does it run,
its output error against fp32 next to autocast's, and how many of its graphs' matmul/conv/attention nodes run low.

    python benchmarks/survey_dynamo.py [--names a,b] [--dtype bfloat16|float16]

One line per model, then a markdown table. "low / all": matmul-family nodes painted low over all of them, in every
graph and checkpoint body. "error x autocast": max abs error of ours over autocast's (both vs the fp32 model).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import amp_compiler  # noqa: E402
import amp_compiler.models.torchvision_ops  # noqa: E402,F401
from amp_compiler.dynamo.compile import compiled_graphs  # noqa: E402
from amp_compiler.passes.node_facts import facts  # noqa: E402

FAMILIES = ("matmul", "conv", "attention")


def error(out, reference) -> float:
    return (out.float() - reference.float()).abs().max().item()


def survey(spec, dtype) -> list:
    model = spec.build()
    inputs = spec.inputs()
    with torch.no_grad():
        reference = spec.output(model(*inputs))
        try:
            with torch.autocast("cpu", dtype):
                theirs = error(spec.output(model(*inputs)), reference)
        except Exception as failure:  # noqa: BLE001 - autocast itself fails on it (a constant beyond bf16)
            theirs = float("nan")
            print(f"  {spec.name}: autocast fails: {type(failure).__name__}: {failure}")
    converted = copy.deepcopy(model)
    torch._dynamo.reset()
    start = time.perf_counter()
    amp_compiler.convert(converted, "O1", dtype=dtype, inplace=True, capture="dynamo")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = error(spec.output(converted(*inputs)), reference)
        first = time.perf_counter() - start
        second = error(spec.output(converted(*spec.inputs(spec.sizes[1]))),
                       spec.output(model(*spec.inputs(spec.sizes[1]))))
    nodes = [facts(n).get("precision") for _, gm, _ in compiled_graphs(converted) for sub in gm.modules()
             if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes if facts(n).get("family") in FAMILIES]
    ours_warnings = sorted({type(w.message).__name__ for w in caught if "amp_compiler" in str(w.message)})
    return [spec.name, f"{first:.1f}", len(compiled_graphs(converted)), f"{nodes.count('low')}/{len(nodes)}",
            f"{ours:.2e}", f"{theirs:.2e}", f"{ours / theirs:.2f}" if theirs > 0 else ("autocast fails" if theirs != theirs else "-"), f"{second:.2e}",
            ", ".join(ours_warnings) or "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default="")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from real_models import REAL_MODELS
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    names = [n for n in args.names.split(",") if n] or list(REAL_MODELS)
    rows = []
    for name in names:
        try:
            row = survey(REAL_MODELS[name], dtype)
        except Exception as failure:  # noqa: BLE001 - the survey reports it
            line = traceback.format_exception_only(type(failure), failure)[-1].strip()
            row = [name, "-", "-", "-", "-", "-", "FAILED", "-", line[:160]]
        rows.append(row)
        print("  ".join(map(str, row)), flush=True)
    header = ["model", "first call s", "graphs", "low / all", "error", "autocast error", "error x autocast",
              "2nd size error", "warnings / failure"]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
