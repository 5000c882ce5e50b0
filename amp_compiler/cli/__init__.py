"""The `amp-compiler` command: demo, explain, compare, render, pipelines, export, convert-onnx.

    amp-compiler demo [--model bert] [--dtype float16|bfloat16] [--steps 5] [--html graph.html]
    amp-compiler explain MODULE:FACTORY [--level O2] [--dtype bf16] [--only fp32] [--html out.html]
    amp-compiler --version
The demo lives in demo.py, the insight commands in insight_commands.py, the ONNX ones in onnx_commands.py, what they parse alike in arguments.py.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from amp_compiler import __version__

    parser = argparse.ArgumentParser(prog="amp-compiler", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"amp-compiler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from amp_compiler.cli import demo as demo_cli

    demo_cli.add_demo_parser(sub)
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
        from amp_compiler.cli.arguments import cli_words
        print(f"amp-compiler {args.command}: error: {cli_words(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
