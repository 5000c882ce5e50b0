"""The suite's marks live on the tests: conftest.py names no test and no file (a rename dropped a mark listed
there, silently), and the fast run still skips importing a file marked slow in its own source, by reading the
file's module-level `pytestmark` with ast."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CONFTEST = TESTS / "conftest.py"


@pytest.fixture
def conftest(request):
    return next(plugin for plugin in request.config.pluginmanager.get_plugins()
                if getattr(plugin, "__file__", None) == str(CONFTEST))


class Options:   # the part of pytest's config pytest_ignore_collect reads
    def __init__(self, expression: str):
        self.expression = expression

    def getoption(self, name, default=None):
        assert name == "markexpr"
        return self.expression


def _test_files():
    return sorted(path for path in TESTS.rglob("test_*.py") if "__pycache__" not in path.parts)


def test_conftest_names_no_test_and_no_file(conftest):
    for name in ("SLOW_FILES", "SLOW_TESTS", "_FILE_MARKED"):
        assert not hasattr(conftest, name), name
    names = [node.value for node in ast.walk(ast.parse(CONFTEST.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\btest_\w", node.value)]
    assert names == [], "mark the test itself (@pytest.mark.NAME) or its file (pytestmark), not in conftest.py"


def test_file_marks_reads_the_files_own_pytestmark(conftest, tmp_path):
    assert "slow" in conftest.file_marks(TESTS / "conformance" / "test_zoo_levels.py")
    assert conftest.file_marks(TESTS / "conformance" / "test_real_models.py") == {"real_models"}
    assert conftest.file_marks(TESTS / "passes" / "test_policy_levels.py") == frozenset()   # single tests marked, not the file
    forms = {
        "pytestmark = pytest.mark.slow\n": {"slow"},
        "pytestmark = [pytest.mark.slow, pytest.mark.real_models]\n": {"slow", "real_models"},
        "pytestmark = (pytest.mark.skipif(True, reason='x'),)\n": {"skipif"},
        "from pytest import mark\npytestmark: list = [mark.browser]\n": {"browser"},
        "def test_x():\n    pytestmark = pytest.mark.slow\n": set(),   # not module-level
        "raise SystemExit('imported')\npytestmark = pytest.mark.slow\n": {"slow"},   # read, never run
        "pytestmark = = broken\n": set(),   # pytest reports the syntax error when it imports the file
    }
    for number, (source, marks) in enumerate(forms.items()):
        path = tmp_path / f"test_form_{number}.py"
        path.write_text("import pytest\n" + source)
        assert conftest.file_marks(path) == marks, source


def test_the_fast_run_skips_importing_exactly_the_files_marked_slow_in_their_source(conftest):
    slow = [path for path in _test_files() if "slow" in conftest.file_marks(path)]
    assert TESTS / "conformance" / "test_zoo_levels.py" in slow and TESTS / "onnx" / "test_onnx_node_tests.py" in slow
    for path in _test_files():
        skipped = conftest.pytest_ignore_collect(path, Options("not slow"))
        assert skipped is (True if path in slow else None), path.name
        assert conftest.pytest_ignore_collect(path, Options("slow")) is None, path.name
        assert conftest.pytest_ignore_collect(path, Options("")) is None, path.name
    assert conftest.pytest_ignore_collect(TESTS / "conformance" / "test_real_models.py", Options("not real_models")) is True
    assert conftest.pytest_ignore_collect(TESTS / "conformance" / "test_real_models.py", Options("not slow or real_models")) is None


@pytest.mark.slow
def test_every_test_of_a_file_marked_slow_in_its_source_is_slow_once_imported(conftest):
    """What the fast run skips at collection is what `-m "not slow"` deselects after importing: collected as
    arguments (not skipped at collection), `-m slow` selects all N tests (the count pytest prints when every
    test is selected) and `-m "not slow or UNKNOWN"` none of them. So `-m "not slow"` selects the same number with and without the collection skip."""
    slow = [str(path) for path in _test_files() if "slow" in conftest.file_marks(path)]

    def collected(*options: str) -> str:
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *options, *slow], cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
        assert run.returncode in (0, 5), run.stdout[-2000:] + run.stderr[-2000:]
        return run.stdout.strip().splitlines()[-1]

    every = int(re.match(r"(\d+) tests? collected", collected("-m", "slow")).group(1))
    assert every > 0
    assert re.match(rf"no tests collected \({every} deselected\)", collected("-m", "not slow or unregistered_mark"))
