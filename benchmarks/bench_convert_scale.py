"""convert()'s own cost against issue 22's targets, and against depth. One subprocess per row (a fresh process: the
first conversion's one-time costs included, as a user meets them; peak RSS is that row's alone).

    1000-block MLP (Linear+ReLU, fx front end)            target <= 0.5 s
    HF Llama config, 32 layers, hidden 32 (torch.export)  target <= 2 s
    Llama-3-8B shape on the meta device (torch.export)    target <= 5 s and <= 1 GB RSS
then the time against depth (the Llama at 8/16/32/64 layers, the MLP at 250/500/1000/2000 blocks): linear when
"s per block" stays flat. The "before" column is commit 464202c on the same machine (2 CPU cores); the issue's
figures were taken on another machine.

    python benchmarks/bench_convert_scale.py [--depth]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

# (issue's figure, commit 464202c on this machine): seconds; None where the conversion failed
BEFORE = {"mlp:1000": (1.83, 0.95), "llama:32": (6.7, 7.89), "llama8b:32": (17.9, None)}
TARGETS = {"mlp:1000": "<= 0.5 s", "llama:32": "<= 2 s", "llama8b:32": "<= 5 s, <= 1 GB"}


def build(kind: str, size: int):
    import torch
    from torch import nn
    if kind == "mlp":
        layers = []
        for _ in range(size):
            layers += [nn.Linear(16, 16), nn.ReLU()]
        return nn.Sequential(*layers), None
    import amp_compiler.models.torchvision_ops  # noqa: F401 - transformers imports torchvision
    import transformers
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=size,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                          use_cache=False)
    else:   # Llama-3-8B's shape, no weights
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=size, num_attention_heads=32, num_key_value_heads=8,
                                          max_position_embeddings=8192, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta" if kind == "llama8b" else "cpu"):
        model = transformers.LlamaForCausalLM(config).eval()
    return model, (torch.randint(0, 128, (2, 16)),)


def child(kind: str, size: int) -> dict:
    import torch
    import amp_compiler
    warnings.filterwarnings("ignore")
    model, inputs = build(kind, size)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    seconds = time.perf_counter() - start
    copied = any("copied from block 2" in note for note in gm.meta["amp"]["notes"])
    return {"seconds": seconds, "nodes": len(gm.graph.nodes), "frontend": gm.meta["amp"]["frontend"],
            "copied": copied, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "base_mb": base}


def run_child(kind: str, size: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(size)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(out.stdout.strip().splitlines()[-1])


NAMES = {"mlp": "MLP, blocks", "llama": "HF Llama (hidden 32), layers", "llama8b": "Llama-3-8B shape on meta, layers"}


def targets() -> None:
    from bench_convert import table
    rows = []
    for key in BEFORE:
        kind, size = key.split(":")
        r = run_child(kind, int(size))
        issue, before = BEFORE[key]
        if "error" in r:
            rows.append([f"{NAMES[kind]} {size}", "FAILED", r["error"], "", "", "", TARGETS[key]])
            continue
        rows.append([f"{NAMES[kind]} {size}", r["nodes"], f"{issue:.2f}", "failed" if before is None else f"{before:.2f}",
                     f"{r['seconds']:.2f}", f"{r['peak_mb']:.0f} (+{r['peak_mb'] - r['base_mb']:.0f})", TARGETS[key]])
    table("convert() O1 bf16, fresh process per row (issue 22 targets)",
          ["model", "fx nodes", "issue s", "before s", "now s", "peak RSS MB (+during)", "target"], rows)


def depth() -> None:
    from bench_convert import table
    for kind, sizes in (("llama", (8, 16, 32, 64)), ("mlp", (250, 500, 1000, 2000))):
        rows, previous = [], None
        for size in sizes:
            r = run_child(kind, size)
            if "error" in r:
                rows.append([size, "FAILED", r["error"], "", "", ""])
                continue
            growth = f"{r['seconds'] / previous:.2f}x" if previous else "-"
            previous = r["seconds"]
            rows.append([size, r["nodes"], f"{r['seconds']:.2f}", f"{r['seconds'] / size * 1e3:.1f}", growth,
                         "yes" if r["copied"] else "no"])
        table(f"convert() against depth: {NAMES[kind]}", ["size", "fx nodes", "seconds", "ms per block",
                                                           "vs previous", "blocks copied"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", action="store_true", help="also time convert() against depth")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    targets()
    if args.depth:
        depth()


if __name__ == "__main__":
    main()
