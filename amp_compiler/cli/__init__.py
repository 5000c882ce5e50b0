"""The `amp-compiler` command: demo, explain, compare, render, pipelines, export, convert-onnx.

    amp-compiler demo [--model bert] [--dtype float16|bfloat16] [--steps 12] [--html graph.html]
    amp-compiler explain MODULE:FACTORY [--level O2] [--dtype bf16] [--only fp32] [--html out.html]
    amp-compiler --version
The demo lives in demo.py, the insight commands in insight_commands.py, the ONNX ones in onnx_commands.py, what they
parse alike in arguments.py. The parser is built without torch (no module here imports it at its top): --help,
--version and a bad flag are answered before torch loads; a command's handler imports what it runs.
An error is one line on stderr, `amp-compiler <command>: error: ...` (--traceback prints the whole traceback
instead); exit codes: 0 ok, 1 compare/--validate past tolerance, 2 usage error or the user's code failing,
3 any other error.
"""
from __future__ import annotations

import argparse
import logging
import sys

from amp_compiler.cli.arguments import CommandLineParser, report_error

# torch loggers that print a traceback of their own for an error the command then reports in one line
QUIETED_LOGGERS = ("torch._subclasses.fake_tensor",)


def build_parser() -> argparse.ArgumentParser:
    from amp_compiler import __version__
    from amp_compiler.cli import demo as demo_cli
    from amp_compiler.cli import insight_commands as insight_cli
    from amp_compiler.cli import onnx_commands as onnx_cli

    parser = CommandLineParser(prog="amp-compiler", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"amp-compiler {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, print the whole Python traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_cli.add_demo_parser(sub)
    insight_cli.add_insight_parsers(sub)
    onnx_cli.add_export_parser(sub)
    onnx_cli.add_convert_onnx_parser(sub)
    for command in sub.choices.values():   # after the command too; SUPPRESS: absent, it leaves the top's value
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(None if argv is None else [str(a) for a in argv])
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return args.func(args)
    except Exception as error:
        if args.traceback:
            raise
        return report_error(args.command, error, args)


if __name__ == "__main__":
    sys.exit(main())
