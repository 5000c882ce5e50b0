"""amp_compiler.compile(model, backend="inductor") against torch.compile(model) + torch.autocast, bf16 on CPU.

    python benchmarks/bench_compile.py [--rounds 5] [--threads 2] [--what train,decode]

Both sides are compiled by inductor; the only difference is who decides precision: autocast's op lists, traced
into the graph by dynamo (autocast entered once around the step / the decode, as users write it), or the
project's passes on dynamo's graph. Table 1, a training step (forward, fp32 loss, backward, AdamW) of a small
Llama-shaped causal LM; Table 2, a greedy decode with a DynamicCache (prefill, then one token per forward), the
same loop for both, under no_grad. Medians of alternated rounds after a warm-up (the compilations are timed
apart, in the "first call s" column). Also fp32 torch.compile, for reference.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import amp_compiler  # noqa: E402
import amp_compiler.models.torchvision_ops  # noqa: E402,F401  (transformers imports torchvision's C ops)
from bench_decode import markdown  # noqa: E402  (this folder is the script's first path entry)

LOW = torch.bfloat16


def llama(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config)


def variants(model) -> dict:
    """name -> (compiled model, the region its step runs in)."""
    autocast = lambda: torch.autocast("cpu", dtype=LOW)   # noqa: E731
    plain = contextlib.nullcontext
    return {
        "fp32 torch.compile": (torch.compile(copy.deepcopy(model)), plain),
        "torch.compile + autocast": (torch.compile(copy.deepcopy(model)), autocast),
        "amp_compiler.compile": (amp_compiler.compile(copy.deepcopy(model), "O1", dtype=LOW, backend="inductor"),
                                 plain),
    }


def train_step(variant, ids) -> float:
    model, region, optimizer = variant
    start = time.perf_counter()
    with region():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.float().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def decode(variant, prompt, new: int) -> tuple[float, float]:
    """(prefill s, mean decode s per token)."""
    from transformers import DynamicCache
    model, region = variant[:2]
    cache, ids, times = DynamicCache(), prompt, []
    with torch.no_grad(), region():
        for _ in range(new):
            start = time.perf_counter()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return times[0], statistics.mean(times[1:])


def bench_train(args) -> None:
    model = llama(args.hidden, args.layers, args.vocab).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    runs = {}
    first = {}
    for name, (compiled, region) in variants(model).items():
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        runs[name] = (compiled, region, optimizer)
        first[name] = train_step(runs[name], ids)   # the compilation
        train_step(runs[name], ids)
        print(f"  {name}: first step {first[name]:.1f} s", flush=True)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(train_step(run, ids))
    base = statistics.median(times["torch.compile + autocast"])
    rows = [[name, f"{statistics.median(t) * 1e3:.1f}", f"{statistics.median(t) / base:.2f}", f"{first[name]:.1f}"]
            for name, t in times.items()]
    markdown(f"training step, Llama {args.layers}x{args.hidden} (vocab {args.vocab}), batch {args.batch} x "
             f"{args.seq}, AdamW, bf16 on CPU, {args.threads} thread(s); median of {args.rounds} alternated rounds",
             ["variant", "ms / step", "vs compile + autocast", "first call s"], rows)


def bench_decode(args) -> None:
    model = llama(args.hidden, args.layers, args.vocab).eval()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        torch._dynamo.reset()   # each batch size compiles afresh, as a new process would
        prompt = torch.randint(0, args.vocab, (batch, 32), generator=torch.Generator().manual_seed(batch))
        runs = variants(model)
        first = {}
        for name, run in runs.items():
            start = time.perf_counter()
            decode(run, prompt, args.new)   # prefill, first decode and dynamic decode graphs compiled here
            first[name] = time.perf_counter() - start
            print(f"  batch {batch} {name}: first decode {first[name]:.1f} s", flush=True)
        prefill = {name: [] for name in runs}
        step = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                p, s = decode(run, prompt, args.new)
                prefill[name].append(p)
                step[name].append(s)
        base = statistics.median(step["torch.compile + autocast"])
        for name in runs:
            rows.append([str(batch), name, f"{statistics.median(prefill[name]) * 1e3:.2f}",
                         f"{statistics.median(step[name]) * 1e3:.2f}", f"{statistics.median(step[name]) / base:.2f}",
                         f"{first[name]:.1f}"])
    markdown(f"greedy decode, Llama {args.layers}x{args.hidden} (vocab {args.vocab}), prompt 32, {args.new} new "
             f"tokens, DynamicCache, no_grad, bf16 on CPU, {args.threads} thread(s); median of {args.rounds} rounds",
             ["batch", "variant", "prefill ms", "decode ms/token", "vs compile + autocast", "first decode s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", default="train,decode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    # torch.compile(model) of three copies of one class shares the class's forward code object: dynamo's limit of
    # 8 graphs per code object (prefill + 2 decode graphs each) would leave the third copy running as written
    torch._dynamo.config.recompile_limit = 64
    import doc_tables
    with doc_tables.captured() as printed:
        if "train" in args.what:
            bench_train(args)
        if "decode" in args.what:
            bench_decode(args)
    if args.write_docs:
        doc_tables.write_table("performance.md", "bench-compile", printed.text, doc_tables.command_line())


if __name__ == "__main__":
    main()
