"""Regenerate tests/golden/decisions.json.gz: what convert() decides and generates on the zoo and the
conformance models, read by tests/conformance/test_no_behaviour_change.py (zoo) and tests/conformance/test_real_models.py
(test_decisions_and_code_unchanged).

    python tests/golden/regenerate.py            # about 10 minutes on 2 cores: 42 models x 3 configurations
    python tests/golden/regenerate.py --compare  # writes nothing: lists every key that differs from the file

Run it only for a change that is meant to change decisions or generated code, and say why in the commit
message. It converts with the tree it lives in (the amp_compiler, passes/ and models/ beside it), not with
an installed amp_compiler: an editable install maps amp_compiler.passes to its own checkout, so a finder
put first on sys.meta_path points the three packages here, and every module loaded is checked to come from
here. A git worktree of an older commit can thus regenerate that commit's file.
Keys: "zoo/<name>/<level>-<fp16|bf16>" and "real/<name>/<config of test_real_models.CONFIGS>".
"""
from __future__ import annotations

import importlib.util
import sys
import time
from importlib.abc import MetaPathFinder
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"amp_compiler": ROOT / "amp_compiler", "amp_compiler.passes": ROOT / "passes",
            "amp_compiler.models": ROOT / "models"}


class _ThisTree(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        folder = PACKAGES.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _use_this_tree() -> None:
    sys.meta_path.insert(0, _ThisTree())
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]   # as tests/conftest.py: `models`, real_models


def _check_loaded_from_this_tree() -> None:
    strays = [f"{name}: {module.__file__}" for name, module in list(sys.modules.items())
              if name.split(".")[0] in ("amp_compiler", "models", "golden", "real_models", "test_real_models")
              and getattr(module, "__file__", None) and not Path(module.__file__).resolve().is_relative_to(ROOT)]
    if strays:
        raise SystemExit("modules loaded from another tree:\n  " + "\n  ".join(strays))


def zoo_records() -> dict:
    from golden.decisions import ZOO_DTYPES, ZOO_LEVELS, record, zoo_conversion
    from models import ZOO_NAMES

    return {f"zoo/{name}/{level}-{dtype_name}": record(zoo_conversion(name, level, dtype))
            for name in ZOO_NAMES for level in ZOO_LEVELS for dtype_name, dtype in ZOO_DTYPES.items()}


def real_records() -> dict:
    import test_real_models as suite
    from golden.decisions import record

    records = {}
    for name in suite.REAL_MODEL_NAMES:
        started = time.perf_counter()
        for config in suite.CONFIGS:
            try:
                _, gm = suite.converted(name, config)
            except Exception as error:  # noqa: BLE001 - recorded
                gm = error
            records[f"real/{name}/{config}"] = record(gm)
        print(f"  {name}: {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    return records


def main() -> None:
    _use_this_tree()
    import models.torchvision_ops  # noqa: F401 - as tests/conftest.py: torchvision's op schemas first
    from golden.decisions import GOLDEN, first_difference, load, save

    records = {**zoo_records(), **real_records()}
    _check_loaded_from_this_tree()
    if "--compare" in sys.argv[1:]:
        golden = load()
        differences = [first_difference(key, golden[key], records[key]) if key in golden else f"{key}: not in the file"
                       for key in records]
        differences = [d for d in differences if d] + [f"{key}: no longer recorded" for key in golden if key not in records]
        print("\n".join(differences) or f"all {len(records)} records match {GOLDEN}")
        raise SystemExit(1 if differences else 0)
    save(records)
    print(f"{len(records)} records from {ROOT} -> {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
