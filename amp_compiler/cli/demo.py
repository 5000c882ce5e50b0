"""`amp-compiler demo`: convert a zoo model at O1, print the report, compare with fp32, train a few O2 steps.

demo_training is the demo's training loop (also called by tests/test_train_network.py); it lives beside
the command, not in amp_compiler/train/, which holds what users train with.
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="convert a zoo model at O1, print the report, compare with fp32, train at O2")
    demo.add_argument("--model", default="bert", help="zoo model: mlp, resnet, bert, gpt, gcn, gat")
    demo.add_argument("--dtype", default="bfloat16" if not torch.cuda.is_available() else "float16",
                      help="low precision dtype (default: bfloat16 on CPU, float16 with CUDA)")
    demo.add_argument("--steps", type=int, default=12, help="training steps at O2 (0 to skip)")
    demo.add_argument("--train-dtype", default="float16",
                      help="dtype of the O2 training steps (default float16: shows dynamic loss scaling)")
    demo.add_argument("--html", metavar="OUT.html",
                      help="where to write the picture of the graph (default: the temporary folder)")
    demo.set_defaults(func=run_demo)


def run_demo(args) -> int:
    import amp_compiler
    import amp_compiler.models as zoo   # the repository's models/, installed with the package: runs anywhere

    task = zoo.build(args.model, size="small", seed=0)
    dtype = amp_compiler.config.resolve_dtype(args.dtype)
    print(f"== convert {args.model} at O1, {args.dtype} ==", flush=True)
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
        train_dtype = amp_compiler.config.resolve_dtype(args.train_dtype)
        print(f"== train {args.model} at O2, {args.train_dtype}, {args.steps} steps ==", flush=True)
        task = zoo.build(args.model, size="small", seed=0)
        from amp_compiler.train.loss_scale import default_loss_scale_manager
        print(f"scaling: {default_loss_scale_manager('O2', train_dtype)!r} (build_train_network's default; "
              "an overflowing step is skipped and marked)", flush=True)
        rows, report = demo_training(task, steps=args.steps, level="O2", dtype=train_dtype)
        for step, loss, scale, overflow, note in rows:
            print(f"step {step:3d}  loss {loss:.4f}  loss scale {scale:g}  {note if overflow else ''}", flush=True)
        print(f"skipped steps: {sum(bool(row[3]) for row in rows)}/{len(rows)}")
        print(report)
    return 0


def demo_training(task, steps: int = 5, level: str = "O2", dtype: torch.dtype = torch.float16,
                  lr: float = 1e-3, loss_scale_manager=None) -> tuple[list[tuple], str]:
    """Train a copy of a zoo task's model for `steps` steps; returns one (step, loss, loss_scale, overflow,
    note) row per step and the step's report(). The task's model is left untouched."""
    from amp_compiler.train.network import build_train_network

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
