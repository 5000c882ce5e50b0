"""convert()'s own cost against issue 22's targets, and against depth. One subprocess per row (a fresh process: the
first conversion's one-time costs included, as a user meets them; peak RSS is that row's alone).

    1000-block MLP (Linear+ReLU, fx front end)            target <= 0.5 s
    HF Llama config, 32 layers, hidden 32 (torch.export)  target <= 2 s
    Llama-3-8B shape on the meta device (torch.export)    target <= 5 s and <= 1 GB RSS
then the time against depth (the Llama at 8/16/32/64 layers, the MLP at 250/500/1000/2000 blocks): linear when
"ms per block" stays flat. `--against COMMIT` also converts each row with that commit's amp_compiler (git archive
into a temporary directory) in the same run, so both columns share the machine's load; the issue's figures were
taken on another machine.

    python benchmarks/bench_convert_scale.py [--against 464202c] [--repeats 2] [--depth]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

ISSUE = {"mlp:1000": 1.83, "llama:32": 6.7, "llama8b:32": 17.9}   # seconds, issue 22
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


def run_child(kind: str, size: int, tree: str | None = None) -> dict:
    """One row in a fresh process: this checkout's amp_compiler, or the one extracted into `tree`."""
    script, env = __file__, dict(os.environ)
    if tree is not None:
        script, env["PYTHONPATH"] = os.path.join(tree, "benchmarks", os.path.basename(__file__)), tree
    out = subprocess.run([sys.executable, script, "--child", kind, str(size)], capture_output=True, text=True,
                         check=False, env=env, cwd=tree or ROOT)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def extracted(commit: str, directory: str) -> str:
    """`commit`'s tree in `directory`, importable ahead of the editable install (which maps amp_compiler.passes and
    .models to this checkout: the extracted package gets links to its own)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    for name in ("passes", "models"):
        os.symlink(os.path.join(directory, name), os.path.join(directory, "amp_compiler", name))
    with open(__file__, "rb") as source, open(os.path.join(directory, "benchmarks", os.path.basename(__file__)),
                                              "wb") as copy:
        copy.write(source.read())   # this script, run on the old package
    return directory


def best(kind: str, size: int, repeats: int, tree: str | None = None) -> dict:
    runs = [run_child(kind, size, tree) for _ in range(repeats)]
    good = [r for r in runs if "error" not in r]
    return min(good, key=lambda r: r["seconds"]) if good else runs[0]


NAMES = {"mlp": "MLP, blocks", "llama": "HF Llama (hidden 32), layers", "llama8b": "Llama-3-8B shape on meta, layers"}


def targets(repeats: int, tree: str | None, against: str | None) -> None:
    from bench_convert import table
    rows = []
    for key in ISSUE:
        kind, size = key.split(":")
        now = best(kind, int(size), repeats)
        before = best(kind, int(size), repeats, tree) if tree else None
        was = "-" if before is None else "failed" if "error" in before else f"{before['seconds']:.2f}"
        if "error" in now:
            rows.append([f"{NAMES[kind]} {size}", "FAILED", f"{ISSUE[key]:.2f}", was, now["error"], "", TARGETS[key]])
            continue
        rows.append([f"{NAMES[kind]} {size}", now["nodes"], f"{ISSUE[key]:.2f}", was, f"{now['seconds']:.2f}",
                     f"{now['peak_mb']:.0f} (+{now['peak_mb'] - now['base_mb']:.0f})", TARGETS[key]])
    table(f"convert() O1 bf16, fresh process per row, best of {repeats} (issue 22 targets)",
          ["model", "fx nodes", "issue s", f"{against or 'before'} s", "now s", "peak RSS MB (+during)", "target"],
          rows)


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
    parser.add_argument("--against", help="a commit to time too (e.g. 464202c, before issue 22's work)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md (the targets table)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    import doc_tables
    with tempfile.TemporaryDirectory() as directory, doc_tables.captured() as printed:
        tree = extracted(args.against, directory) if args.against else None
        targets(args.repeats, tree, args.against)
    if args.write_docs:
        doc_tables.write_table("performance.md", "bench-convert-scale", printed.text, doc_tables.command_line())
    if args.depth:
        depth()


if __name__ == "__main__":
    main()
