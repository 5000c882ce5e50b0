"""Training benchmark: activation memory saved for backward per level, and step time against autocast.

    python benchmarks/bench_train.py [--size small|full] [--models mlp,resnet] [--rounds 20] [--scale-steps 40]
    torchrun --nproc_per_node=2 benchmarks/bench_train.py --tables distributed     # CPU, gloo

Table 1: bytes of tensors autograd saves for backward in one forward + fp32 loss of the converted model
(torch.autograd.graph.saved_tensors_hooks; each storage counted once), at O0, O1, O2: activations, and
apart from them the low-precision copies of weights (the fp32 parameters themselves are not counted:
they exist anyway). Target: O2 activations <= 0.6 of O0.
Table 2: milliseconds per training step (median over alternating rounds, all variants timed in the same
loop so machine load hits them alike): fp32 eager; eager under torch.autocast(cpu, bf16) with
torch.amp.GradScaler; build_train_network at O1 and O2 in bf16. Each variant trains its own copy of the
same initial model with AdamW.
Table 3: the first steps in fp16 (issue 10): steps skipped, the first applied step and the final loss (mean
of the last 5 training losses) for build_train_network at O2 with the seeds' initial scale 2**24, with its
default 2**16, and for eager torch.autocast(cpu, fp16) + torch.amp.GradScaler (2**16); fp32 for reference.
Table 4 (under torchrun): ms per step of the model converted at O2 bf16 in a plain loop with a
DynamicLossScaleManager, each rank on its own batch: alone (no communication), in DDP, and sharded with
FSDP2's fully_shard at the root; all ranks run every variant in the same rounds.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # models/ is not installed

from amp_compiler import DynamicLossScaleManager, build_train_network, convert  # noqa: E402
from models import ZOO_NAMES, build  # noqa: E402


# Autograd nodes a low-precision copy of a weight passes through on its way from the parameter.
WEIGHT_COPY_NODES = ("ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                     "UnsafeViewBackward0", "ExpandBackward0")


def is_weight_copy(tensor: torch.Tensor) -> bool:
    """A cast (or transposed view) of a parameter: autograd leads straight back to the parameter."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in WEIGHT_COPY_NODES:
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        if len(parents) != 1:
            return False
        node = parents[0]
    return node is not None and type(node).__name__ == "AccumulateGrad" and tensor.grad_fn is not None


def saved_bytes(task, level: str, dtype: torch.dtype) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) autograd saves in one forward + fp32 loss at `level`."""
    gm = convert(task.model, level, dtype=dtype, example_inputs=task.example_inputs)
    own = {t.untyped_storage().data_ptr() for t in [*task.model.parameters(), *task.model.buffers()]}
    activations: dict[int, int] = {}
    weight_copies: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:  # the parameters themselves exist anyway
            kind = weight_copies if is_weight_copy(tensor) else activations
            kind[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs, target = task.make_batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = gm(*inputs)
        task.loss_fn(output.float(), target)
    return sum(activations.values()), sum(weight_copies.values())


def autocast_step(model, loss_fn, dtype=torch.bfloat16):
    """The plain PyTorch recipe: autocast forward, GradScaler-scaled backward, skipped step on inf.
    Each step returns (loss, whether it was skipped)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")

    def step(inputs, target):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            output = model(*inputs)
        loss = loss_fn(output.float(), target)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss, scaler.get_scale() < scale   # GradScaler backs off exactly when it skipped
    return step


def fp32_step(model, loss_fn):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(inputs, target):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        optimizer.step()
        return loss, False
    return step


def all_low_step(model, loss_fn, dtype=torch.bfloat16):
    """The whole model in `dtype`, inputs too: no cast anywhere, norms and softmax included. Not a usable
    recipe (no fp32 master weights, fragile ops rounded); the floor any cast placement can reach."""
    fp32_run = fp32_step(model.to(dtype), loss_fn)

    def step(inputs, target):
        low = tuple(v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for v in inputs)
        return fp32_run(low, target)
    return step


def compiled_step(model, loss_fn, level, example_inputs, dtype=torch.bfloat16, loss_scale_manager=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step = build_train_network(model, optimizer, loss_fn, level=level, dtype=dtype,
                                     loss_scale_manager=loss_scale_manager, example_inputs=example_inputs)

    def step(inputs, target):
        loss, overflow, _ = train_step(*inputs, target)
        return loss, bool(overflow)
    return step


def step_times(task, rounds: int, warmup: int = 3) -> dict[str, float]:
    variants = {
        "fp32 eager": fp32_step(copy.deepcopy(task.model), task.loss_fn),
        "autocast+GradScaler": autocast_step(copy.deepcopy(task.model), task.loss_fn),
        "ours O1 bf16": compiled_step(copy.deepcopy(task.model), task.loss_fn, "O1", task.example_inputs),
        "ours O2 bf16": compiled_step(copy.deepcopy(task.model), task.loss_fn, "O2", task.example_inputs),
        "all bf16, no cast": all_low_step(copy.deepcopy(task.model), task.loss_fn),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(warmup + rounds):
        inputs, target = task.make_batch(index)
        for name, step in variants.items():  # alternate: every round times every variant once
            start = time.perf_counter()
            step(inputs, target)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


FIRST_STEP_VARIANTS = {   # name -> step factory(model, task); each trains in fp16 except the reference
    "fp32": lambda model, task: fp32_step(model, task.loss_fn),
    "O2 2**24": lambda model, task: compiled_step(model, task.loss_fn, "O2", task.example_inputs, torch.float16,
                                                   DynamicLossScaleManager()),           # the seeds' manager
    "O2 2**16": lambda model, task: compiled_step(model, task.loss_fn, "O2", task.example_inputs,
                                                   torch.float16),                       # the step's default
    "GradScaler": lambda model, task: autocast_step(model, task.loss_fn, torch.float16),
}


def first_steps(task, steps: int, variant: str) -> tuple[int, int | None, float]:
    """(steps skipped, first applied step, mean loss of the last 5 steps) of one variant."""
    step = FIRST_STEP_VARIANTS[variant](copy.deepcopy(task.model), task)
    skipped, losses = [], []
    for index in range(steps):
        inputs, target = task.make_batch(index)
        torch.manual_seed(index)  # the same dropout masks for every variant
        loss, was_skipped = step(inputs, target)
        skipped.append(was_skipped)
        losses.append(float(loss.detach()))
    first_applied = next((i for i, s in enumerate(skipped) if not s), None)
    return sum(skipped), first_applied, sum(losses[-5:]) / 5


def initial_scale_table(names, size: str, steps: int) -> None:
    print(f"\nFirst steps in fp16, {steps} steps: skipped / first applied step / final loss (mean of the last 5)")
    variants = [v for v in FIRST_STEP_VARIANTS if v != "fp32"]
    print(f"{'model':8} " + " ".join(f"{v:>22}" for v in variants) + f" {'fp32 loss':>10}")
    for name in names:
        task = build(name, size=size)
        cells = []
        for variant in variants:
            skipped, first, loss = first_steps(task, steps, variant)
            cells.append(f"{skipped:>3} / {first if first is not None else '-':>3} / {loss:8.4f}")
        reference = first_steps(task, steps, "fp32")[2]
        print(f"{name:8} " + " ".join(f"{c:>22}" for c in cells) + f" {reference:10.4f}", flush=True)


def distributed_table(names, size: str, rounds: int, warmup: int = 3) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    wrappers = {"alone": lambda gm: gm, "DDP": DistributedDataParallel,
                "FSDP2": lambda gm: fully_shard(gm, mesh=mesh)}
    if rank == 0:
        print(f"\nStep time, ms, O2 bf16 plain loop, {world} ranks (median of {rounds} rounds)")
        print(f"{'model':8} " + " ".join(f"{w:>10}" for w in wrappers))
    for name in names:
        task = build(name, size=size)
        steps = {label: plain_loop_step(wrap(convert(copy.deepcopy(task.model), "O2", dtype=torch.bfloat16,
                                                     example_inputs=task.example_inputs)), task.loss_fn)
                 for label, wrap in wrappers.items()}
        times: dict[str, list[float]] = {label: [] for label in steps}
        for index in range(warmup + rounds):
            inputs, target = task.make_batch(index * world + rank)   # each rank its own batch
            for label, step in steps.items():
                dist.barrier()
                start = time.perf_counter()
                step(inputs, target)
                if index >= warmup:
                    times[label].append(time.perf_counter() - start)
        if rank == 0:
            print(f"{name:8} " + " ".join(f"{1000 * statistics.median(times[w]):10.2f}" for w in wrappers),
                  flush=True)
    dist.destroy_process_group()


def plain_loop_step(model, loss_fn):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = DynamicLossScaleManager(2.0 ** 8)   # all-reduces the overflow flag: every rank skips together

    def step(inputs, target):
        optimizer.zero_grad(set_to_none=True)
        manager.scale(loss_fn(model(*inputs).float(), target)).backward()
        manager.step(optimizer)
        manager.update()
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="full", choices=["small", "full"])
    parser.add_argument("--models", default=",".join(ZOO_NAMES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scale-steps", type=int, default=40, help="training steps of the initial-scale table")
    parser.add_argument("--tables", default="memory,time,scale",
                        help="which tables to print: memory, time, scale, distributed (the last under torchrun)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                        help="low dtype for the memory table (the timing table uses bf16, as autocast on CPU)")
    parser.add_argument("--write-docs", action="store_true",
                        help="after printing, write the step-time table (--tables time) into docs/performance.md")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    dtype = getattr(torch, args.dtype)
    if os.environ.get("RANK", "0") == "0":   # under torchrun only the first rank prints
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, zoo size {args.size!r}")

    tables = args.tables.split(",")
    if "memory" in tables:
        memory_table(names, args.size, dtype, args.dtype)
    if "time" in tables:
        import doc_tables
        with doc_tables.captured() as printed:
            time_table(names, args.size, args.rounds)
        if args.write_docs:
            doc_tables.write_table("performance.md", "bench-train-time", printed.text, doc_tables.command_line())
    elif args.write_docs:
        parser.error("--write-docs writes the step-time table: add time to --tables")
    if "scale" in tables:
        initial_scale_table(names, args.size, args.scale_steps)
    if "distributed" in tables:
        distributed_table(names, args.size, args.rounds)


def memory_table(names, size: str, dtype: torch.dtype, dtype_name: str) -> None:
    print(f"\nBytes saved for backward ({dtype_name}): activations, and the low-precision weight copies O2 saves "
          "besides (target: O2/O0 activations <= 0.60)")
    print(f"{'model':8} {'O0':>12} {'O1':>12} {'O2':>12} {'O1/O0':>6} {'O2/O0':>6} {'target':>7} "
          f"{'O2 copies':>12} {'O2+copies/O0':>13}")
    for name in names:
        task = build(name, size=size)
        (o0, _), (o1, _), (o2, copies) = (saved_bytes(task, level, dtype) for level in ("O0", "O1", "O2"))
        verdict = "met" if o2 <= 0.6 * o0 else "MISSED"
        print(f"{name:8} {o0:12,d} {o1:12,d} {o2:12,d} {o1 / o0:6.2f} {o2 / o0:6.2f} {verdict:>7} "
              f"{copies:12,d} {(o2 + copies) / o0:13.2f}")


def time_table(names, size: str, rounds: int) -> None:
    print(f"\nStep time, ms (median of {rounds} alternating rounds)")
    print("'all bf16, no cast': the model and inputs in bf16, nothing cast, norms and softmax rounded: the floor of "
          "any cast placement, not a recipe")
    columns = ["fp32 eager", "autocast+GradScaler", "ours O1 bf16", "ours O2 bf16", "all bf16, no cast"]
    print(f"{'model':8} " + " ".join(f"{c:>20}" for c in columns) + f" {'O1/autocast':>12} {'floor/autocast':>15}")
    for name in names:
        times = step_times(build(name, size=size), rounds)
        ratio = times["ours O1 bf16"] / times["autocast+GradScaler"]
        floor = times["all bf16, no cast"] / times["autocast+GradScaler"]
        print(f"{name:8} " + " ".join(f"{times[c]:20.2f}" for c in columns) + f" {ratio:12.2f} {floor:15.2f}")


if __name__ == "__main__":
    main()
