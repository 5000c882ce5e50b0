"""`import amp_compiler` stays light: the ONNX entry points load onnx, onnx_ir and onnxruntime on first use."""
import os
import subprocess
import sys

import pytest

import amp_compiler

pytestmark = pytest.mark.slow  # fresh interpreters: 10 s

ONNX_NAMES = ["export_onnx", "convert_onnx", "validate_onnx", "OnnxConversionReport"]
HEAVY_MODULES = ["onnx", "onnx_ir", "onnxscript", "onnxruntime"]


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(amp_compiler.__path__[0])).stdout.strip()


def test_importing_the_package_loads_no_onnx_module():
    loaded = _python(f"import sys, amp_compiler; print([m for m in {HEAVY_MODULES!r} if m in sys.modules])")
    assert loaded == "[]"


def test_onnx_names_import_on_first_use_and_stay_listed():
    assert set(ONNX_NAMES) <= set(amp_compiler.__all__) <= set(dir(amp_compiler))
    assert _python("from amp_compiler import export_onnx; print(export_onnx.__module__)") == "amp_compiler.onnx.export"
    assert _python("from amp_compiler import *; print(OnnxConversionReport.__name__)") == "OnnxConversionReport"
    assert all(hasattr(amp_compiler, name) for name in amp_compiler.__all__)
