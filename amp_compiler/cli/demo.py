"""`amp-compiler demo`: convert a zoo model at O1, print the report, compare with fp32, train a few O2 steps.

The float16 training steps use a DynamicLossScaleManager at its own default start, 2**24: the first steps'
scaled gradients overflow float16, so the demo shows the scale backing off (each step's line says so) before
the steps apply. build_train_network's default starts at 2**16, where the zoo's small models never overflow.

demo_training is the demo's training loop (also called by tests/train/test_train_network.py); it lives beside
the command, not in amp_compiler/train/, which holds what users train with. torch is imported by the
handler, not here: the parser is built without it.
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import argparse

from amp_compiler.cli.arguments import did_you_mean, dtype_argument

ZOO_NAMES = ("mlp", "resnet", "bert", "gpt", "gcn", "gat")   # amp_compiler.models.ZOO_NAMES (imports torch)


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="convert a zoo model at O1, print the report, compare with fp32, train at O2")
    demo.add_argument("--model", default="bert", type=zoo_name, help=f"zoo model: {', '.join(ZOO_NAMES)}")
    demo.add_argument("--dtype", type=dtype_argument,
                      help="low precision dtype (default: bfloat16 on CPU, float16 with CUDA)")
    demo.add_argument("--steps", type=int, default=12, help="training steps at O2 (0 to skip)")
    demo.add_argument("--train-dtype", default="float16", type=dtype_argument,
                      help="dtype of the O2 training steps (default float16: shows dynamic loss scaling)")
    demo.add_argument("--html", metavar="OUT.html",
                      help="where to write the picture of the graph (default: the temporary folder)")
    demo.set_defaults(func=run_demo)


def zoo_name(text: str) -> str:
    if text in ZOO_NAMES:
        return text
    raise argparse.ArgumentTypeError(f"unknown model {text!r}{did_you_mean(text, ZOO_NAMES)} "
                                     f"(zoo models: {', '.join(ZOO_NAMES)})")


def run_demo(args) -> int:
    import torch

    import amp_compiler
    import amp_compiler.models as zoo   # the repository's models/, installed with the package: runs anywhere

    task = zoo.build(args.model, size="small", seed=0)
    dtype_name = args.dtype or ("float16" if torch.cuda.is_available() else "bfloat16")
    dtype = amp_compiler.config.resolve_dtype(dtype_name)
    print(f"== convert {args.model} at O1, {dtype_name} ==", flush=True)
    gm = amp_compiler.convert(task.model, "O1", dtype=dtype, example_inputs=task.example_inputs)
    report = amp_compiler.explain(gm)
    print("\n".join(report.summary_lines()))
    html = amp_compiler.render(gm, args.html or Path(tempfile.gettempdir()) / f"amp-compiler-demo-{args.model}.html")
    print(f"graph and rules of all {report.totals['rows']} nodes: {html.resolve()} (open it in a browser; "
          f"`amp-compiler explain amp_compiler.models:build --kwarg name={args.model} --table` prints them)")
    task.model.eval()
    gm.eval()
    with torch.no_grad():
        reference = task.model(*task.example_inputs).float()
        converted = gm(*task.example_inputs).float()
    error = (converted - reference).abs().max().item()
    scale = reference.abs().max().item()
    print(f"casts inserted: {report.totals['casts']}; max |mixed - fp32| = {error:.3g} "
          f"(output magnitude {scale:.3g}, relative {error / max(scale, 1e-12):.2%})")
    if args.steps > 0:
        train_at_o2(args, zoo.build(args.model, size="small", seed=0))
    return 0


def train_at_o2(args, task) -> None:
    """The O2 steps: each step's loss and loss scale, a back-off written `scale -> new scale`, then the report."""
    import amp_compiler
    from amp_compiler.train.loss_scale import DynamicLossScaleManager, default_loss_scale_manager
    from amp_compiler.train.step_outcome import scale_label

    train_dtype = amp_compiler.config.resolve_dtype(args.train_dtype)
    print(f"== train {args.model} at O2, {args.train_dtype}, {args.steps} steps ==", flush=True)
    manager = default_loss_scale_manager("O2", train_dtype)
    if isinstance(manager, DynamicLossScaleManager):
        manager = DynamicLossScaleManager()     # starts at 2**24: the first scaled gradients overflow float16
        why = ("DynamicLossScaleManager's own start, on purpose: the first steps overflow float16 and the scale "
               "backs off until the gradients fit; build_train_network's default starts at 2**16")
    else:
        why = "build_train_network's default for this dtype"
    print(f"scaling: {manager!r} ({why}; an overflowing step is skipped and marked)", flush=True)
    rows, report = demo_training(task, steps=args.steps, level="O2", dtype=train_dtype, loss_scale_manager=manager)
    after = [row[2] for row in rows[1:]] + [float(manager.get_loss_scale()) if manager else rows[-1][2]]
    for (step, loss, scale, overflow, note), next_scale in zip(rows, after):
        moved = f" -> {scale_label(next_scale)}" if next_scale != scale else ""
        print(f"step {step:3d}  loss {loss:.4f}  loss scale {scale_label(scale)}{moved}  {note if overflow else ''}"
              .rstrip(), flush=True)
    print(report)


def demo_training(task, steps: int = 5, level: str = "O2", dtype=None,
                  lr: float = 1e-3, loss_scale_manager=None) -> tuple[list[tuple], str]:
    """Train a copy of a zoo task's model for `steps` steps at `dtype` (default torch.float16); returns one
    (step, loss, loss_scale, overflow, note) row per step and the step's report(). The task's model is left
    untouched."""
    import torch

    from amp_compiler.train.network import build_train_network

    dtype = torch.float16 if dtype is None else dtype

    model = copy.deepcopy(task.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    step = build_train_network(model, optimizer, task.loss_fn, level=level, dtype=dtype,
                               loss_scale_manager=loss_scale_manager, example_inputs=task.example_inputs)
    rows = []
    for index in range(steps):
        inputs, target = task.make_batch(index)
        loss, overflow, loss_scale = step(*inputs, target)
        rows.append((index, float(loss), loss_scale, overflow, step.last_note))
    return rows, step.report()
