"""The `export` and `convert-onnx` subcommands, for amp_compiler/cli/__init__.py to mount on its parser.

    amp-compiler export amp_compiler.models:build out.onnx --kwarg name=bert --level O1 [--validate [--rtol 0.01]]
    amp-compiler export amp_compiler.models:build out.onnx --kwarg name=gpt --level fp8 --fp8-min-dim 16 [--calibrate]
    amp-compiler convert-onnx model.onnx model_fp16.onnx --level O1 [--op-block-list Softmax ...]

MODULE:FACTORY names a callable; it returns an object with .model and .example_inputs (a models.ZooTask),
a (model, example_inputs) pair, or a bare nn.Module (then --input-shape gives fp32 example inputs).
Each parser sets func=handler; a handler takes the parsed args and returns the exit code (0 ok, 1 when
--validate finds the file past tolerance, 2 for a usage error such as a bad file or factory, printed as one
line on stderr by arguments.report_error). A bad --level or --dtype is refused while parsing.
"""
from __future__ import annotations

import argparse

from amp_compiler.cli.arguments import (FP8_RTOL_HELP, LEVEL_CHOICES_HELP, ZOO_FACTORY, add_factory_inputs,
                                        add_fp8_options, calibration_samples, dtype_argument, fp8_overrides,
                                        level_argument, load_factory, report_error)


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="convert a PyTorch model and export it as mixed-precision ONNX",
        description="Convert MODULE:FACTORY's model with the amp rules and export it with torch.onnx (dynamo).")
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help=f"e.g. mymodels:make, path/to/mymodels.py:make or {ZOO_FACTORY} --kwarg name=bert")
    parser.add_argument("output", metavar="OUT.onnx")
    add_factory_inputs(parser)
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate on the factory's calibration_data (else its example inputs): ranges, and at "
                             "--level fp8 static activation scales")
    _add_common(parser)
    add_fp8_options(parser)
    parser.add_argument("--validate", action="store_true",
                        help="compare the ONNX model with the PyTorch model on the example inputs")
    parser.add_argument("--rtol", type=float,
                        help=f"--validate's tolerance relative to each value's scale (default 0.01, {FP8_RTOL_HELP} for a "
                             f"file with float8 matmuls)")
    parser.add_argument("--atol", type=float, default=1e-2, help="--validate's absolute tolerance on top (default 0.01)")
    parser.set_defaults(func=run_export)
    return parser


def add_convert_onnx_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "convert-onnx", help="convert an fp32 ONNX file to mixed precision with the same rules",
        description="Apply the amp op policy to an existing ONNX model and write the mixed-precision model.")
    parser.add_argument("input", metavar="IN.onnx")
    parser.add_argument("output", metavar="OUT.onnx")
    _add_common(parser)
    add_fp8_options(parser, calibrates=False)
    parser.add_argument("--op-block-list", nargs="+", default=None, metavar="OP_TYPE",
                        help="ONNX op types kept in fp32 (e.g. Softmax LayerNormalization)")
    parser.add_argument("--node-block-list", nargs="+", default=None, metavar="NODE",
                        help="node names kept in fp32")
    parser.add_argument("--table", action="store_true", help="print every node's precision and rule")
    parser.set_defaults(func=run_convert_onnx)
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--level", default="O1", type=level_argument, help=LEVEL_CHOICES_HELP)
    parser.add_argument("--dtype", default="float16", type=dtype_argument, help="float16/fp16 (default) or bfloat16/bf16")
    parser.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                        help="let inputs and outputs take the low dtype (default: they keep theirs)")
    parser.add_argument("--force-fp32", nargs="+", default=(), metavar="PATTERN",
                        help="node names or module paths (glob) kept in fp32")


def run_export(args) -> int:
    from amp_compiler.onnx.export import export_onnx
    from amp_compiler.onnx.files import UnwritableDestinationError
    from amp_compiler.onnx.validate import validate_onnx
    try:
        model, example_inputs, calibration = load_factory(args.factory, args.kwarg, args.input_shape)
        report = export_onnx(model, example_inputs, args.output, level=args.level, dtype=args.dtype,
                             keep_io_types=args.keep_io_types, **_force(args), **fp8_overrides(args),
                             calibration_data=calibration_samples(args, example_inputs, calibration))
        print(report)
        if args.validate:
            validation = validate_onnx(args.output, model, example_inputs, rtol=args.rtol, atol=args.atol)
            print(validation)
            return 0 if validation.passed else 1
    except (ValueError, TypeError, FileNotFoundError, UnwritableDestinationError) as error:
        return report_error("export", error, args)
    return 0


def run_convert_onnx(args) -> int:
    from amp_compiler.onnx.convert import convert_onnx
    from amp_compiler.onnx.files import UnwritableDestinationError
    try:
        report = convert_onnx(args.input, args.output, level=args.level, dtype=args.dtype,
                              keep_io_types=args.keep_io_types, op_block_list=args.op_block_list,
                              node_block_list=args.node_block_list, **_force(args), **fp8_overrides(args))
    except (ValueError, TypeError, FileNotFoundError, UnwritableDestinationError) as error:
        return report_error("convert-onnx", error, args)
    print(report)
    if args.table:
        print(report.table())
    return 0


def _force(args) -> dict:
    return {"force_fp32": list(args.force_fp32)} if args.force_fp32 else {}

