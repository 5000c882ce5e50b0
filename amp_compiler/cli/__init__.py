"""The `amp-compiler` command: demo, explain, compare, render, export, convert-onnx.

    amp-compiler demo [--model bert] [--dtype float16|bfloat16] [--steps 5] [--html graph.html]
    amp-compiler explain MODULE:FACTORY [--level O2] [--dtype bf16] [--only fp32] [--html out.html]
    amp-compiler --version
The insight commands live in insight_commands.py, the ONNX ones in onnx_commands.py, what they parse alike in arguments.py.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def run_demo(args) -> int:
    import amp_compiler
    import amp_compiler.models as zoo   # the repository's models/, installed with the package: runs anywhere
    from amp_compiler.train.network import demo_training

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


def build_parser() -> argparse.ArgumentParser:
    from amp_compiler import __version__

    parser = argparse.ArgumentParser(prog="amp-compiler", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"amp-compiler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
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
    from amp_compiler.cli import insight_commands as insight_cli

    insight_cli.add_insight_parsers(sub)
    from amp_compiler.cli import onnx_commands as onnx_cli

    onnx_cli.add_export_parser(sub)
    onnx_cli.add_convert_onnx_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as error:
        print(f"amp-compiler {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
