"""The `explain`, `compare` and `render` subcommands, for amp_compiler/cli/__init__.py to mount on its parser.

    amp-compiler explain MODULE:FACTORY [--level O2] [--dtype bf16] [--only fp32] [--html out.html]
    amp-compiler compare MODULE:FACTORY [--level O2] [--rtol 0.01]
    amp-compiler compare MODULE:FACTORY --level fp8 [--fp8-scaling delayed] [--fp8-min-dim 16] [--fp8-keep lm_head]
    amp-compiler render  model_fp16.onnx out.html      (or MODULE:FACTORY out.html / out.svg)

MODULE:FACTORY names a function to call (with --kwarg NAME=VALUE keywords): MODULE is a module importable
from the current directory (`mymodels`, `pkg.models`) or a file path (`path/to/mymodels.py`). The
factory returns the fp32 model and its example inputs: a pair `(model, example_inputs)`, where
example_inputs is a tuple of positional inputs (or one tensor), or an object with `.model` and
`.example_inputs` (the zoo: `amp_compiler.models:build --kwarg name=gpt`), or a bare nn.Module (then
--input-shape gives its fp32 example inputs); a third element (or a `.calibration_data` attribute), a list of
input tuples, is what `--calibrate` runs the ranges on. A handler returns the exit code: 0 ok, 1 when compare
finds the outputs past tolerance; an error it raises is main()'s one line (2 for a usage error).
Nothing here imports torch at its top: the parsers are built before torch loads.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from amp_compiler.cli.arguments import (FP8_RTOL_HELP, LEVEL_CHOICES_HELP, ZOO_FACTORY, add_factory_inputs,
                                        add_fp8_options, calibration_samples, convert_dtype, dtype_argument,
                                        fp8_overrides, level_argument, load_factory)


def add_insight_parsers(subparsers) -> None:
    explain = subparsers.add_parser("explain", help="convert MODULE:FACTORY's model and print what it decided",
                                    description="Convert the factory's model and print the report's summary "
                                                "(the table too with --table or a filter).")
    _add_model(explain)
    explain.add_argument("--only", help="rows of one precision: low, fp32, cast, untouched or a dtype name")
    explain.add_argument("--module", help="rows under module paths matching this glob (encoder.*)")
    explain.add_argument("--op", help="rows whose canonical op matches this glob (softmax)")
    explain.add_argument("--table", action="store_true", help="print every node's row, grouped by module")
    explain.add_argument("--html", metavar="OUT.html", help="also write the picture of the graph (render)")
    explain.set_defaults(func=run_explain)

    compare = subparsers.add_parser("compare", help="per-node error of the converted model against fp32",
                                    description="Convert the factory's model, run both on its example inputs "
                                                "and print each node's error, worst first, and the first node "
                                                "past tolerance. Exit code 1 when the outputs are past it.")
    _add_model(compare)
    compare.add_argument("--rtol", type=float, help=f"tolerance relative to each value's scale (default 0.01 for "
                                                    f"float16, 0.05 for bfloat16, {FP8_RTOL_HELP} where float8 matmuls run)")
    compare.set_defaults(func=run_compare)

    render = subparsers.add_parser("render", help="draw a converted model or an ONNX file as one HTML/SVG file",
                                   description="Write the picture of SOURCE: an .onnx file (precision from its "
                                               "types) or MODULE:FACTORY (converted first).")
    render.add_argument("source", metavar="MODEL.onnx|MODULE:FACTORY")
    render.add_argument("output", metavar="OUT.html")
    _add_model(render, with_source=False)
    render.set_defaults(func=run_render)

    pipelines = subparsers.add_parser("pipelines", help="print every pass of every pipeline, in order",
                                      description="Print the fx, ONNX and export pipelines (passes/pipelines.py), "
                                                  "each pass with its condition and decide_precision's hooks.")
    pipelines.add_argument("--facts", action="store_true", help="what each pass reads and writes instead")
    pipelines.add_argument("--update", nargs="+", metavar="FILE.md",
                           help="rewrite the pipeline listings (fenced blocks) in these Markdown files")
    pipelines.set_defaults(func=run_pipelines)


def _add_model(parser: argparse.ArgumentParser, with_source: bool = True) -> None:
    if with_source:
        parser.add_argument("factory", metavar="MODULE:FACTORY",
                            help=f"e.g. mymodels:make, path/to/mymodels.py:make or {ZOO_FACTORY} --kwarg name=gpt")
    add_factory_inputs(parser)
    parser.add_argument("--level", default="O1", type=level_argument, help=LEVEL_CHOICES_HELP)
    parser.add_argument("--dtype", type=dtype_argument,
                        help="float16/fp16 (default) or bfloat16/bf16 (at --level fp8: bfloat16)")
    parser.add_argument("--calibrate", action="store_true",
                        help="range calibration on the factory's calibration_data (else its example inputs)")
    add_fp8_options(parser)


def run_explain(args) -> int:
    import amp_compiler

    model, inputs, gm = _converted(args)
    report = amp_compiler.explain(gm, only=args.only, module=args.module, op=args.op, full=args.table)
    filtered = any(v is not None for v in (args.only, args.module, args.op))
    print("\n".join(report.summary_lines()))
    if args.table or filtered:
        print("\n".join(report.table_lines()))
    else:
        print(f"({report.totals['rows']} rows: --table prints them, --only/--module/--op filter them)")
    if args.html:
        print(f"graph written to {amp_compiler.render(gm, args.html).resolve()} (open it in a browser)")
    return 0


def run_compare(args) -> int:
    import amp_compiler

    model, inputs, gm = _converted(args)
    report = amp_compiler.compare(model, gm, inputs, rtol=args.rtol)
    print(report)
    return 0 if report.passed else 1


def run_render(args) -> int:
    import amp_compiler

    if args.source.lower().endswith(".onnx"):
        if not Path(args.source).is_file():
            raise ValueError(f"{args.source}: no such file")
        source = args.source
    else:
        args.factory = args.source
        source = _converted(args)[2]
    print(f"graph written to {amp_compiler.render(source, args.output).resolve()} (open it in a browser)")
    return 0


def _converted(args) -> tuple:
    """(the factory's model, its example inputs, the converted GraphModule)."""
    import amp_compiler

    model, inputs, calibration = load_factory(args.factory, args.kwarg, args.input_shape)
    overrides = {**convert_dtype(args), **fp8_overrides(args)}
    return model, inputs, amp_compiler.convert(model, args.level, example_inputs=inputs, **overrides,
                                               calibration_data=calibration_samples(args, inputs, calibration))


def run_pipelines(args) -> int:
    from pathlib import Path

    from amp_compiler.passes.pipelines import describe, with_listings_updated
    if args.update:
        for path in map(Path, args.update):
            path.write_text(with_listings_updated(path.read_text()))
        return 0
    print(describe(facts_tables=args.facts))
    return 0
