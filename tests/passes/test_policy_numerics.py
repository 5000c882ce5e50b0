"""passes/policy/numerics.py is the one place for dtype facts and for the op names passes decide by.

The scans read the source of passes/ and amp_compiler/: a second FP16_MAX, a third dtype_name or a pass's
own set of op names fails here, naming the file, so the next op added is seen in op_policy.py + numerics.py.
"""
import ast
from pathlib import Path

import onnx_ir as ir
import torch

from amp_compiler.passes.policy import numerics
from amp_compiler.passes.policy.op_policy import POLICY

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*ROOT.glob("passes/**/*.py"), *ROOT.glob("amp_compiler/**/*.py")])
NUMERICS = ROOT / "passes" / "policy" / "numerics.py"
# Sets of canonical op names that are no precision decision, with why.
NOT_DECISIONS = {("passes/fx/fold_batch_norms.py", "_ATEN_CONVS"):
                 "ATen overload names of the convs export folds a batch norm into: matching, not precision"}


def _module_level(path: Path):
    for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            yield [t.id for t in targets if isinstance(t, ast.Name)], stmt.value
        elif isinstance(stmt, ast.FunctionDef):
            yield [stmt.name], stmt


def _strings(value) -> list[str] | None:
    """The members of a set/tuple/list literal of strings (frozenset({...}) too), else None."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("frozenset", "set", "tuple") and value.args:
        value = value.args[0]
    if isinstance(value, (ast.Set, ast.Tuple, ast.List)) and value.elts and \
            all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
        return [e.value for e in value.elts]
    return None


def test_dtype_name_spells_torch_and_onnx_dtypes_alike():
    assert [numerics.dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.int64, None)] == \
        ["float16", "bfloat16", "float32", "int64", "-"]
    assert [numerics.dtype_name(d) for d in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT,
                                             ir.DataType.DOUBLE)] == ["float16", "bfloat16", "float32", "double"]


def test_low_dtype_limits_are_the_dtypes_own():
    assert numerics.FP16_MAX == 65504.0 == numerics.low_max("float16") == numerics.low_max(torch.float16)
    assert numerics.BF16_MAX == torch.finfo(torch.bfloat16).max == numerics.low_max("bfloat16")


def test_dtype_facts_are_defined_once():
    defined = [f"{path.relative_to(ROOT)}: {name}" for path in SOURCES if path != NUMERICS
               for names, _ in _module_level(path) for name in names
               if name in ("FP16_MAX", "BF16_MAX", "dtype_name", "low_max", "low_finfo")]
    assert not defined, f"defined again outside passes/policy/numerics.py: {defined}"


def test_op_name_sets_live_beside_the_policy_table():
    found = []
    for path in SOURCES:
        where = str(path.relative_to(ROOT))
        if where.startswith("passes/policy/"):
            continue
        for names, value in _module_level(path):
            members = _strings(value)
            if members and all(m in POLICY for m in members) and \
                    not any((where, name) in NOT_DECISIONS for name in names):
                found.append(f"{where}: {names} = {members}")
    assert not found, f"op-name sets outside op_policy.py/numerics.py (move them to numerics.py): {found}"


def test_numerics_op_sets_name_ops_of_the_table():
    # IN_PLACE_OPERATORS holds Python's operator names (iadd), which canonicalize maps to ops (add).
    unknown = {name: sorted(set(value) - set(POLICY)) for name, value in vars(numerics).items()
               if isinstance(value, frozenset) and name != "IN_PLACE_OPERATORS" and set(value) - set(POLICY)}
    assert not unknown, f"numerics.py names ops the policy table does not know: {unknown}"
