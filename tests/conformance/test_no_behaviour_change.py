"""Every zoo model at every level in both dtypes decides and generates what tests/golden/ recorded.

A refactor must not change a decision or a line of generated code; a change meant to do so regenerates the
record (python tests/golden/regenerate.py) and says why in its commit. The conformance models are compared
in tests/conformance/test_real_models.py (test_decisions_and_code_unchanged), on the conversions that suite caches.
"""
import pytest

from golden.decisions import ZOO_DTYPES, ZOO_LEVELS, first_difference, load, record, zoo_conversion
from models import ZOO_NAMES


@pytest.mark.parametrize("dtype", list(ZOO_DTYPES))
@pytest.mark.parametrize("level", ZOO_LEVELS)
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_decisions_and_code_unchanged(name, level, dtype):
    key = f"zoo/{name}/{level}-{dtype}"
    difference = first_difference(key, load()[key], record(zoo_conversion(name, level, ZOO_DTYPES[dtype])))
    if difference:
        pytest.fail(difference, pytrace=False)
