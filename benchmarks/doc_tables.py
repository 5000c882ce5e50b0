"""Benchmarks write their own tables into the docs (issue 33), so a figure on a page is the one a command printed.

A page marks each table a benchmark owns:

    <!-- table: NAME (written by COMMAND) -->
    ...whatever is there now...
    <!-- /table: NAME -->

`write_table(page, name, table_text, command)` replaces everything between the two markers with the table in a
fenced block and one line saying which command printed it, on which date and machine (CPU model or GPU name,
threads, torch version). The start marker is rewritten to name the command that ran; the rest of the page is kept
byte for byte. A page without both markers for NAME is refused (ValueError naming the markers to add), so a
benchmark never appends a table somewhere nobody reads it. Benchmarks call it after printing, under `--write-docs`:

    with doc_tables.captured() as printed:   # tee what the table prints
        print_the_table()
    if args.write_docs:
        doc_tables.write_table("performance.md", "bench-placement", printed.text, doc_tables.command_line())
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The marker pair; NAME is one word (letters, digits, - _ .), COMMAND anything without ") -->".
START = re.compile(r"<!-- table: (?P<name>[\w.-]+) \(written by (?P<command>.+?)\) -->")


def start_marker(name: str, command: str) -> str:
    return f"<!-- table: {name} (written by {command}) -->"


def end_marker(name: str) -> str:
    return f"<!-- /table: {name} -->"


def markers(text: str) -> list[tuple[str, str]]:
    """(name, command) of every table marker in a page's text, in order."""
    return [(m["name"], m["command"]) for m in START.finditer(text)]


def machine() -> str:
    """A short description of where the numbers came from: device, threads, torch version."""
    import torch
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = _cpu_model()
    threads = torch.get_num_threads()
    return f"{device}, {threads} thread{'s' if threads != 1 else ''}, torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:   # not Linux
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def command_line(argv: list[str] | None = None) -> str:
    """The command as a reader would type it from the repository root: `python benchmarks/x.py --flags`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        script_text = str(script.relative_to(ROOT))
    except ValueError:   # run from outside the checkout
        script_text = argv[0]
    return " ".join(["python", script_text, *(shlex.quote(a) for a in argv[1:])])


def block(name: str, table_text: str, command: str, when: datetime.date | None = None,
          where: str | None = None) -> str:
    """The text from the start marker to the end marker, both included."""
    when = when or datetime.date.today()
    body = table_text.strip("\n")
    fence = "````" if "```" in body else "```"
    return (f"{start_marker(name, command)}\n\n{fence}text\n{body}\n{fence}\n\n"
            f"`{command}` on {when.isoformat()}, {where or machine()}\n\n{end_marker(name)}")


def replaced(text: str, name: str, table_text: str, command: str, page: str = "the page",
             when: datetime.date | None = None, where: str | None = None) -> str:
    """The page's text with NAME's block replaced; refuses a page without both markers."""
    starts = [m for m in START.finditer(text) if m["name"] == name]
    end = text.find(end_marker(name), starts[0].end()) if len(starts) == 1 else -1
    if len(starts) != 1 or end < 0:
        found = "found twice" if len(starts) > 1 else "missing"
        raise ValueError(f"table {name!r}: its markers are {found} in {page}; put the table between "
                         f"'{start_marker(name, command)}' and '{end_marker(name)}' (once) and run again")
    end += len(end_marker(name))
    return text[:starts[0].start()] + block(name, table_text, command, when, where) + text[end:]


def write_table(page: str, name: str, table_text: str, command: str, docs: Path | str = DOCS,
                when: datetime.date | None = None, where: str | None = None) -> Path:
    """Replace table NAME's block in docs/PAGE with TABLE_TEXT and the line naming COMMAND; returns the path."""
    path = Path(docs) / page
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such page for table {name!r}; pass a page under {docs}")
    text = path.read_bytes().decode("utf-8")   # bytes: the rest of the page keeps its line endings as they are
    path.write_bytes(replaced(text, name, table_text, command, str(path), when, where).encode("utf-8"))
    print(f"wrote table {name!r} into {path}", file=sys.stderr)
    return path


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.buffer = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.buffer.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    @property
    def text(self) -> str:
        return self.buffer.getvalue()


@contextlib.contextmanager
def captured():
    """Print as usual and keep a copy: `with captured() as printed: ...; printed.text`."""
    tee, original = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        yield tee
    finally:
        sys.stdout = original

