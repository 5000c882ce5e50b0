"""benchmarks/doc_tables.py writes a benchmark's table into its page (issue 33): only between the table's markers,
the rest of the page byte for byte, with the command, date and machine; a page without the markers is refused.
And every table marker in docs/ names a script in benchmarks/ that takes --write-docs, so no page claims a table
is written by a command that cannot write it."""
import datetime
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("doc_tables", ROOT / "benchmarks" / "doc_tables.py")
doc_tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(doc_tables)

TABLE = "model  ms\n-----  --\nmlp    1.5\n"
BEFORE = "# Page\r\n\r\nIntro with trailing space \nand ünïcode.\n\n"
AFTER = ("\n\nAfter the table.\r\n<!-- table: other (written by python benchmarks/other.py) -->\nkept\n"
         "<!-- /table: other -->\n")


def page_with(block: str, tmp_path: Path) -> Path:
    path = tmp_path / "page.md"
    path.write_bytes((BEFORE + block + AFTER).encode("utf-8"))
    return path


def marked(name: str, command: str, inside: str) -> str:
    return f"{doc_tables.start_marker(name, command)}\n{inside}\n{doc_tables.end_marker(name)}"


def test_write_table_replaces_only_its_block_and_names_command_date_and_machine(tmp_path):
    path = page_with(marked("mine", "python benchmarks/old.py", "| old | table |\n| 1 | 2 |"), tmp_path)
    command = "python benchmarks/bench_x.py --rounds 3 --write-docs"
    doc_tables.write_table("page.md", "mine", TABLE, command, docs=tmp_path, where="Test CPU, 1 thread, torch x")
    data = path.read_bytes().decode("utf-8")
    assert data.startswith(BEFORE) and data.endswith(AFTER)   # byte for byte, \r\n and trailing spaces included
    block = data[len(BEFORE):len(data) - len(AFTER)]
    today = datetime.date.today().isoformat()
    assert block == (f"<!-- table: mine (written by {command}) -->\n\n```text\n{TABLE.strip()}\n```\n\n"
                     f"`{command}` on {today}, Test CPU, 1 thread, torch x\n\n<!-- /table: mine -->")
    assert "| old | table |" not in data
    assert doc_tables.markers(data) == [("mine", command), ("other", "python benchmarks/other.py")]

    # a second write replaces the first one's block, the rest again untouched
    doc_tables.write_table("page.md", "mine", "second\n", "python benchmarks/bench_x.py", docs=tmp_path)
    again = path.read_bytes().decode("utf-8")
    assert again.startswith(BEFORE) and again.endswith(AFTER)
    assert "second" in again and "mlp    1.5" not in again and again.count("<!-- /table: mine -->") == 1
    line = next(line for line in again.splitlines() if line.startswith("`python benchmarks/bench_x.py`"))
    assert f" on {today}, " in line and "torch " in line and "thread" in line


@pytest.mark.parametrize("block, why", [
    ("no markers at all", "missing"),
    ("<!-- table: mine (written by python benchmarks/x.py) -->\nno end marker", "missing"),
    ("text\n<!-- /table: mine -->", "missing"),
    (marked("mine", "python benchmarks/x.py", "a") + "\n" + marked("mine", "python benchmarks/x.py", "b"),
     "found twice"),
])
def test_write_table_refuses_a_page_without_exactly_one_pair_of_markers(tmp_path, block, why):
    path = page_with(block, tmp_path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=rf"table 'mine': its markers are {why} in .*page\.md.*"
                                         r"<!-- table: mine \(written by python benchmarks/x\.py\) -->"):
        doc_tables.write_table("page.md", "mine", TABLE, "python benchmarks/x.py", docs=tmp_path)
    assert path.read_bytes() == before   # nothing written


def test_write_table_refuses_a_missing_page(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.md"):
        doc_tables.write_table("nowhere.md", "mine", TABLE, "python benchmarks/x.py", docs=tmp_path)


def test_command_line_names_the_script_from_the_repository_root():
    argv = [str(ROOT / "benchmarks" / "bench_x.py"), "--only", "a b", "--write-docs"]
    assert doc_tables.command_line(argv) == "python benchmarks/bench_x.py --only 'a b' --write-docs"


def scripts_lacking_write_docs(commands: list[str], root: Path) -> list[str]:
    """Each marker command that does not run a script under benchmarks/ whose --help lists --write-docs."""
    problems, helps = [], {}
    for command in commands:
        words = shlex.split(command)
        script = words[1] if len(words) > 1 and words[0] == "python" else ""
        if not re.fullmatch(r"benchmarks/\w+\.py", script) or not (root / script).is_file():
            problems.append(f"{command}: not 'python benchmarks/<script>.py ...' naming a script there")
        elif script not in helps:   # --help of every script at once: each imports torch
            helps[script] = subprocess.Popen([sys.executable, str(root / script), "--help"], cwd=root,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for script, process in helps.items():
        out, _ = process.communicate(timeout=120)
        if process.returncode or "--write-docs" not in out:
            problems.append(f"{script}: its --help does not list --write-docs (exit {process.returncode})")
    return problems


def test_the_check_catches_a_script_without_the_flag(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "with_flag.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--write-docs', action='store_true')\n"
        "p.parse_args()\n")
    (tmp_path / "benchmarks" / "without.py").write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    problems = scripts_lacking_write_docs(["python benchmarks/with_flag.py --x", "python benchmarks/without.py",
                                           "python benchmarks/absent.py", "torchrun other.py"], tmp_path)
    assert [p.split(":")[0] for p in problems] == ["python benchmarks/absent.py", "torchrun other.py",
                                                   "benchmarks/without.py"]


def test_every_table_marker_in_the_docs_names_a_benchmark_that_takes_write_docs():
    found = {page.name: doc_tables.markers(page.read_text(encoding="utf-8"))
             for page in sorted((ROOT / "docs").glob("*.md"))}
    commands = [command for marks in found.values() for _, command in marks]
    assert len(commands) >= 3 and "bench-scale-out" in dict(found["scale-out.md"]), found
    for page, marks in found.items():   # each marker closed, once
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        for name, _ in marks:
            assert text.count(doc_tables.end_marker(name)) == 1, f"docs/{page}: table {name!r} lacks one end marker"
    assert not scripts_lacking_write_docs(commands, ROOT)
