"""Decode latency of a Llama-shaped model, bf16 on CPU: fp32, torch.autocast, and converted in place (O1, on
TorchDynamo, its weight cache on by default: one oneDNN-packed bf16 copy per linear) and with weight_cache=False
(every weight cast on every call). Greedy, KV cache on; alternated runs, medians.

Every variant runs as users run it: the whole decode under `torch.no_grad()` (what `generate()` uses), and
autocast entered once around it, `with torch.autocast(...): model.generate(...)`, so autocast's weight-cast
cache lives for the whole call (15 weight casts for 15 linears over a decode, not 15 per token). Entering
autocast per forward, or running under `inference_mode` (where autocast caches nothing), times an autocast
no user runs and flatters every other variant.

    python benchmarks/bench_decode.py [--batches 1,8] [--repeats 7] [--vocab 8000] [--threads 2]
    python benchmarks/bench_decode.py --profile "in place" --batches 1     # cProfile of the decode steps

Each run: one prefill forward over the prompt (its time is the "prefill" column), then --new - 1 forwards of
one token each reading the KV cache (their mean is "decode ms/token"). The same greedy loop for every
variant, written out here rather than generate(), so its bookkeeping is no part of either figure.
The in-place models are warmed first: dynamo makes their graphs on the first calls (prefill, decode).
The "generate ms" column times `model.generate(max_new_tokens=--new)` itself, end to end, in the same contexts.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import amp_compiler  # noqa: E402
import amp_compiler.models.torchvision_ops  # noqa: E402,F401  (transformers imports torchvision's C ops)

LOW = torch.bfloat16
VARIANTS = ("fp32", "autocast", "in place", "in place uncached")


def llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def variants(model, names=VARIANTS) -> dict:
    """name -> (model, the context the whole decode runs in); each in-place one is a copy."""
    def autocast_region():
        return torch.autocast("cpu", dtype=LOW)   # once around the decode, as around generate()

    makers = {
        "fp32": lambda: (model, contextlib.nullcontext),
        "autocast": lambda: (model, autocast_region),
        "in place": lambda: (amp_compiler.convert(copy.deepcopy(model), "O1", dtype=LOW, inplace=True),
                             contextlib.nullcontext),
        "in place uncached": lambda: (amp_compiler.convert(copy.deepcopy(model), "O1", dtype=LOW, inplace=True,
                                                                   weight_cache=False), contextlib.nullcontext),
    }
    return {name: makers[name]() for name in names}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def greedy(variant, prompt: torch.Tensor, new: int, config, clock=time.perf_counter) -> tuple[list[float], torch.Tensor]:
    """Milliseconds of each forward (the first is the prefill) and the generated tokens; the variant's context
    (autocast) and no_grad are entered once around the whole loop, as generate() runs."""
    from transformers import DynamicCache
    run, region = variant
    cache, ids, times, tokens = DynamicCache(config=config), prompt, [], []
    with torch.no_grad(), region():
        for _ in range(new):
            start = clock()
            logits = run(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            times.append((clock() - start) * 1e3)
            tokens.append(ids)
    return times, torch.cat(tokens, 1)


def generate_ms(variant, prompt: torch.Tensor, new: int, clock=time.perf_counter) -> float:
    """Milliseconds of one `model.generate()` call, greedy, inside the variant's context."""
    run, region = variant
    start = clock()
    with region():
        run.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                     do_sample=False, pad_token_id=0)
    return (clock() - start) * 1e3


def measure(runs: dict, prompt, new: int, repeats: int, config, clock) -> tuple[dict, dict]:
    """name -> (median prefill ms, median decode ms/token, median generate ms); name -> tokens (vs fp32's)."""
    prefill = {name: [] for name in runs}
    decode = {name: [] for name in runs}
    whole = {name: [] for name in runs}
    tokens = {}
    for name, run in runs.items():   # warm-up: captures, frozen copies, allocator
        greedy(run, prompt, new, config)
        generate_ms(run, prompt, new)
    for _ in range(repeats):         # alternated: drift hits every variant alike
        for name, run in runs.items():
            times, tokens[name] = greedy(run, prompt, new, config, clock)
            prefill[name].append(times[0])
            decode[name].append(statistics.mean(times[1:]))
            whole[name].append(generate_ms(run, prompt, new, clock))
    return {name: (statistics.median(prefill[name]), statistics.median(decode[name]),
                   statistics.median(whole[name])) for name in runs}, tokens


def profile(run, prompt, new: int, config, top: int) -> str:
    greedy(run, prompt, new, config)
    profiler = cProfile.Profile()
    profiler.enable()
    greedy(run, prompt, new, config)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def markdown(title: str, header: list, rows: list) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=24, help="new tokens (the first comes from the prefill)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="cpu: this process's CPU time (at 1 thread, what other processes on the machine "
                             "cannot inflate)")
    parser.add_argument("--profile", choices=VARIANTS, help="print a cProfile of this variant instead")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="which to run (fp32 and autocast always: the ratios are to them)")
    parser.add_argument("--top", type=int, default=25, help="rows of the profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model = llama(args.vocab, args.hidden, args.intermediate, args.layers, args.heads)
    chosen = [name for name in VARIANTS if name in ("fp32", "autocast") or name in args.variants.split(",")]
    runs = variants(model, chosen)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        if args.profile:
            print(f"batch {batch}, {args.profile}:\n" + profile(runs[args.profile], prompt, args.new, model.config,
                                                              args.top))
            continue
        ms, tokens = measure(runs, prompt, args.new, args.repeats, model.config, CLOCKS[args.clock])
        for name in chosen:
            prefill, decode, whole = ms[name]
            same = (tokens[name] == tokens["fp32"]).float().mean().item()
            rows.append([str(batch), name, f"{prefill:.2f}", f"{decode:.2f}", f"{decode / ms['fp32'][1]:.2f}",
                         f"{decode / ms['autocast'][1]:.2f}", f"{prefill / ms['autocast'][0]:.2f}",
                         f"{whole:.1f}", f"{whole / ms['autocast'][2]:.2f}", f"{same:.0%}"])
            print("  ".join(rows[-1]), flush=True)
    if args.profile:
        return
    params = sum(p.numel() for p in model.parameters()) / 1e6
    markdown(f"decode latency, Llama {args.layers}x{args.hidden} (intermediate {args.intermediate}, {args.heads} "
             f"heads, vocab {args.vocab}, {params:.1f}M parameters), bf16 on CPU, "
             f"{args.threads} thread(s), {args.clock} clock, prompt {args.prompt}, {args.new} new tokens greedy, KV cache, under no_grad with autocast "
             f"entered once around each decode (as around generate()); median of {args.repeats} alternated runs",
             ["batch", "variant", "prefill ms", "decode ms/token", "decode vs fp32", "decode vs autocast",
              "prefill vs autocast", "generate ms", "generate vs autocast", "tokens = fp32's"], rows)
    for name in [n for n in chosen if n in VARIANTS[2:]]:
        made = len(amp_compiler.dynamo.graphs(runs[name][0]))
        print(f"\n{name}: {made} graphs, cached weight copies {amp_compiler.frozen_bytes(runs[name][0]) / 1e6:.1f} "
              f"MB (fp32 parameters {params * 4:.1f} MB)")


if __name__ == "__main__":
    main()
