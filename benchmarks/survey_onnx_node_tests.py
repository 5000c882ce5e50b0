"""convert_onnx on every float case of the ONNX backend node tests (generated from the installed onnx
package), with the checks of tests/onnx/test_onnx_node_tests.py: checker, ONNX Runtime run, fp16 tolerance,
exact ints, byte-identical re-conversion, nothing clipped. Prints one row per level and what failed.

    python benchmarks/survey_onnx_node_tests.py [--levels O1 O3] [--weights] [--match resize]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from onnx_node_cases import SourceNotRunnable, check_conversion, float_cases  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["O1", "O3"])
    parser.add_argument("--weights", action="store_true", help="float inputs become initializers")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cases = {n: c for n, c in float_cases().items() if args.match in n}
    rows, failures = [], collections.defaultdict(list)
    for level in args.levels:
        counts, started = collections.Counter(), time.perf_counter()
        for name, case in cases.items():
            with tempfile.TemporaryDirectory() as folder:
                try:
                    check_conversion(case, level, folder, weights=args.weights)
                    counts["ok"] += 1
                except SourceNotRunnable:
                    counts["ORT cannot run the source"] += 1
                except Exception as error:  # noqa: BLE001 - the survey reports every failure
                    counts["failed"] += 1
                    failures[level].append(f"{name}: {type(error).__name__}: {str(error).strip().splitlines()[0][:160]}")
        rows.append((level, counts["ok"], counts["failed"], counts["ORT cannot run the source"],
                     time.perf_counter() - started))
    print(f"{len(cases)} float node-test cases{' (float inputs as weights)' if args.weights else ''}")
    print(f"{'level':<6} {'ok':>6} {'failed':>7} {'ORT cannot run the fp32 source':>31} {'seconds':>8}")
    for level, ok, failed, skipped, seconds in rows:
        print(f"{level:<6} {ok:>6} {failed:>7} {skipped:>31} {seconds:>8.1f}")
    for level, lines in failures.items():
        print(f"\nfailed at {level}:")
        print("\n".join(f"  {line}" for line in lines))


if __name__ == "__main__":
    main()
