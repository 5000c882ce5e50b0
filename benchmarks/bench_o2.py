"""O2 with low weights and fp32 masters against autocast and the no-cast floor; prints three tables.

    python benchmarks/bench_o2.py [--models lnmlp,attention,unet,mlp,resnet,bert,gpt] [--rounds 10]
    python benchmarks/bench_o2.py --tables loss [--steps 200]
    python benchmarks/bench_o2.py --tables ddp

Table 1, ms per optimizer step, CPU bf16, every variant timed in the same rounds (median): the no-cast floor
(model, inputs and AdamW all bf16: nothing casts, fragile ops rounded; the limit no placement can beat),
eager torch.autocast with fp32 AdamW, and ours at O2 casting every weight in every forward (store_weights_low
=False, the previous O2) and with the weights stored low (the default). `step` rows run build_train_network's
one-graph step; `k=4` rows a plain loop of 4 micro-batches per optimizer step through convert()'s GraphModule
(low_weights(gm, optimizer) for the stored variant), where the stored weights are cast once per step, not 4 times.
Table 2, bytes of weights + gradients + optimizer state after a step (AdamW), per variant.
Table 3 (--tables loss): the mean of the last 5 training losses after --steps AdamW steps, fp32 against O2 with
stored weights in bf16 and in fp16 (dynamic loss scale), on the zoo.
Table 4 (--tables ddp): the bytes DistributedDataParallel's gradient buckets all-reduce per backward, O2 bf16
casting every forward (fp32 gradients of the masters) against weights stored low (the copies' bf16 gradients).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from amp_compiler import build_train_network, convert, low_weights  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402

LOW = torch.bfloat16


# -- three models the zoo does not have ----------------------------------------------------------------------
class LayerNormMLP(nn.Module):
    def __init__(self, width=512, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class AttentionBlock(nn.Module):
    def __init__(self, width=256, heads=4, depth=2):
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width),
            "norm2": nn.LayerNorm(width), "up": nn.Linear(width, 4 * width), "down": nn.Linear(4 * width, width)})
            for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        b, t, c = x.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["norm1"](x)).reshape(b, t, 3, self.heads, c // self.heads).unbind(2)
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            attention = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1)
            x = x + layer["proj"]((attention @ v).transpose(1, 2).reshape(b, t, c))
            x = x + layer["down"](torch.nn.functional.gelu(layer["up"](layer["norm2"](x))))
        return self.head(x.mean(1))


class SmallUNet(nn.Module):
    def __init__(self, channels=(32, 64, 128)):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())
        c1, c2, c3 = channels
        self.down1, self.down2, self.mid = block(3, c1), block(c1, c2), block(c2, c3)
        self.up2, self.dec2 = nn.ConvTranspose2d(c3, c2, 2, stride=2), block(2 * c2, c2)
        self.up1, self.dec1 = nn.ConvTranspose2d(c2, c1, 2, stride=2), block(2 * c1, c1)
        self.out = nn.Conv2d(c1, 3, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(nn.functional.max_pool2d(d1, 2))
        m = self.mid(nn.functional.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return self.out(u1)


UNSEEN = {   # name -> (model, make_batch(step), loss_fn)
    "lnmlp": (LayerNormMLP, lambda g: (torch.randn(128, 512, generator=g), torch.randint(0, 10, (128,), generator=g)),
              nn.functional.cross_entropy),
    "attention": (AttentionBlock, lambda g: (torch.randn(16, 128, 256, generator=g),
                                             torch.randint(0, 10, (16,), generator=g)), nn.functional.cross_entropy),
    "unet": (SmallUNet, lambda g: (torch.randn(8, 3, 64, 64, generator=g), torch.randn(8, 3, 64, 64, generator=g)),
             nn.functional.mse_loss),
}


class Task:
    """A fresh seeded fp32 model, batches by step, a loss: what every variant trains."""

    def __init__(self, name: str, size: str) -> None:
        self.name = name
        if name in UNSEEN:
            kind, batch, self.loss_fn = UNSEEN[name]
            torch.manual_seed(0)
            self.model = kind()
            self._batch = batch
        else:
            task = build(name, size=size)
            self.model, self.loss_fn, self._zoo = task.model, task.loss_fn, task

    def make_batch(self, step: int) -> tuple[tuple, torch.Tensor]:
        if self.name in UNSEEN:
            x, y = self._batch(torch.Generator().manual_seed(step))
            return (x,), y
        return self._zoo.make_batch(step)


def _low(inputs):
    return tuple(v.to(LOW) if torch.is_tensor(v) and v.is_floating_point() else v for v in inputs)


def _float_target(target):
    return target.to(LOW) if target.is_floating_point() else target


# -- variants: each returns (run(batches), tensors it keeps: weights, grads, optimizer state) -----------------
def floor(task):
    model = copy.deepcopy(task.model).to(LOW)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(batches):
        for inputs, target in batches:
            task.loss_fn(model(*_low(inputs)), _float_target(target)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return run, (model, optimizer, None)


def autocast(task):
    model = copy.deepcopy(task.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(batches):
        for inputs, target in batches:
            with torch.autocast("cpu", dtype=LOW):
                output = model(*inputs)
            task.loss_fn(output.float(), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return run, (model, optimizer, None)


def o2_step(store: bool):
    def variant(task):
        model = copy.deepcopy(task.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = build_train_network(model, optimizer, task.loss_fn, "O2", dtype=LOW, store_weights_low=store,
                                   example_inputs=task.make_batch(0)[0])

        def run(batches):
            for inputs, target in batches:
                step(*inputs, target)
        return run, (model, optimizer, step.low_weights)
    return variant


def o2_plain(store: bool):
    def variant(task):
        model = copy.deepcopy(task.model)
        gm = convert(model, "O2", dtype=LOW, example_inputs=task.make_batch(0)[0])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        weights = low_weights(gm, optimizer) if store else None

        def run(batches):
            for inputs, target in batches:
                task.loss_fn(gm(*inputs).float(), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return run, (model, optimizer, weights)
    return variant


STEP_VARIANTS = {"floor": floor, "autocast": autocast, "O2 cast": o2_step(False), "O2 stored": o2_step(True)}
PLAIN_VARIANTS = {"floor": floor, "autocast": autocast, "O2 cast": o2_plain(False), "O2 stored": o2_plain(True)}


def timed(task, variants: dict, micro_batches: int, rounds: int, warmup: int = 2) -> tuple[dict, dict]:
    built = {name: make(task) for name, make in variants.items()}
    gc.collect()
    gc.freeze()   # conversion garbage would otherwise land in the timed steps as gen-2 collections
    samples = {name: [] for name in built}
    for index in range(warmup + rounds):
        batches = [task.make_batch(index * micro_batches + k) for k in range(micro_batches)]
        for name, (run, _) in built.items():
            start = time.perf_counter()
            run(batches)
            if index >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    gc.unfreeze()
    return ({name: statistics.median(values) for name, values in samples.items()},
            {name: state_bytes(*kept) for name, (_, kept) in built.items()})


def state_bytes(model, optimizer, weights) -> int:
    """Weights (and low copies) + gradients + optimizer state, each storage once."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if weights is not None:
        tensors += [pair.low for pair in weights.pairs]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def speed_tables(names, size: str, rounds: int) -> None:
    print(f"Table 1: ms per optimizer step, CPU {LOW}, {torch.get_num_threads()} threads, median of {rounds} "
          "alternated rounds")
    print("| model | loop | floor | autocast | O2 cast | O2 stored | stored/floor | stored/autocast | cast/autocast |")
    print("|---|---|---|---|---|---|---|---|---|")
    memory = {}
    for name in names:
        task = Task(name, size)
        for loop, variants, k in (("step", STEP_VARIANTS, 1), ("k=4", PLAIN_VARIANTS, 4)):
            ms, nbytes = timed(task, variants, k, rounds)
            memory.setdefault(name, nbytes)
            print(f"| {name} | {loop} | {ms['floor']:.1f} | {ms['autocast']:.1f} | {ms['O2 cast']:.1f} | "
                  f"{ms['O2 stored']:.1f} | {ms['O2 stored'] / ms['floor']:.2f} | "
                  f"{ms['O2 stored'] / ms['autocast']:.2f} | {ms['O2 cast'] / ms['autocast']:.2f} |", flush=True)
    print("\nTable 2: MiB of weights + gradients + AdamW state after a step (O2 stored: + the low copies)")
    print("| model | floor | autocast | O2 cast | O2 stored | stored/autocast |")
    print("|---|---|---|---|---|---|")
    for name, nbytes in memory.items():
        mib = {k: v / 2 ** 20 for k, v in nbytes.items()}
        print(f"| {name} | {mib['floor']:.1f} | {mib['autocast']:.1f} | {mib['O2 cast']:.1f} | "
              f"{mib['O2 stored']:.1f} | {nbytes['O2 stored'] / nbytes['autocast']:.3f} |")


def allreduce_bytes(task, store: bool) -> int:
    """Bytes DDP's gradient buckets hand to the all-reduce in one backward (a comm hook counts them), on a
    one-process gloo group: the traffic per step scales with these bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel
    model = copy.deepcopy(task.model)
    gm = convert(model, "O2", dtype=LOW, example_inputs=task.make_batch(0)[0])
    if store:
        low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = DistributedDataParallel(gm)
    counted = []

    def counting_hook(state, bucket):
        counted.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, counting_hook)
    inputs, target = task.make_batch(0)
    task.loss_fn(ddp(*inputs).float(), target).backward()
    return sum(counted)


def ddp_table(names, size: str) -> None:
    import tempfile
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as folder:   # the file store removes its file itself
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        print("Table 4: MiB DDP all-reduces per backward (gradient buckets), O2 bf16")
        print("| model | weights cast each forward (fp32 gradients) | weights stored low (bf16 gradients) | ratio |")
        print("|---|---|---|---|")
        for name in names:
            task = Task(name, size)
            cast, stored = allreduce_bytes(task, False), allreduce_bytes(task, True)
            print(f"| {name} | {cast / 2**20:.2f} | {stored / 2**20:.2f} | {stored / cast:.2f} |", flush=True)
        dist.destroy_process_group()


def final_loss(task, dtype, steps: int, autocast_dtype=None) -> float:
    model = copy.deepcopy(task.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if autocast_dtype is not None:   # the recipe users compare against: autocast + GradScaler
        scaler = torch.amp.GradScaler("cpu", enabled=autocast_dtype == torch.float16)

        def step(inputs, target):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=autocast_dtype):
                output = model(*inputs)
            loss = task.loss_fn(output.float(), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            return loss.detach()
    elif dtype is None:
        def step(inputs, target):
            optimizer.zero_grad()
            loss = task.loss_fn(model(*inputs), target)
            loss.backward()
            optimizer.step()
            return loss.detach()
    else:
        train = build_train_network(model, optimizer, task.loss_fn, "O2", dtype=dtype)

        def step(inputs, target):
            return train(*inputs, target)[0]
    losses = [float(step(*task.make_batch(i))) for i in range(steps)]
    return statistics.mean(losses[-5:])


def loss_table(names, size: str, steps: int) -> None:
    print(f"Table 3: mean of the last 5 losses after {steps} AdamW steps (size {size})")
    print("| model | fp32 | O2 stored bf16 | autocast bf16 | O2 stored fp16 (dynamic scale) | autocast fp16 + "
          "GradScaler |")
    print("|---|---|---|---|---|---|")
    for name in names:
        task = Task(name, size)
        row = [final_loss(task, None, steps), final_loss(task, torch.bfloat16, steps),
               final_loss(task, None, steps, torch.bfloat16), final_loss(task, torch.float16, steps),
               final_loss(task, None, steps, torch.float16)]
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in row) + " |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join([*UNSEEN, *ZOO_NAMES]))
    parser.add_argument("--size", default="full", choices=("small", "full"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tables", default="speed", choices=("speed", "loss", "ddp"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the table into docs/performance.md (--tables speed)")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if args.write_docs and args.tables != "speed":
        parser.error("--write-docs writes the speed and memory tables (--tables speed)")
    if args.tables == "speed":
        import doc_tables
        with doc_tables.captured() as printed:
            speed_tables(names, args.size, args.rounds)
        if args.write_docs:
            doc_tables.write_table("performance.md", "bench-o2", printed.text, doc_tables.command_line())
    elif args.tables == "ddp":
        ddp_table(names, args.size)
    else:
        loss_table([n for n in names if n in ZOO_NAMES], "small", args.steps)


if __name__ == "__main__":
    main()
