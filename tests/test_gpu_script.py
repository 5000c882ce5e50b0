"""benchmarks/gpu.py runs on CPU with --dry-run (tiny sizes), so the CUDA script cannot rot unnoticed."""
import importlib.util
import sys
from pathlib import Path

import pytest

import amp_compiler

pytestmark = pytest.mark.slow  # benchmarks/gpu.py's dry run: 8 s

GPU_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def test_the_gpu_script_dry_run_fills_every_section(capsys):
    spec = importlib.util.spec_from_file_location("gpu_benchmark", GPU_SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu          # dataclasses look their module up there
    spec.loader.exec_module(gpu)
    rows = gpu.main(["--dry-run", "--budget-s", "600"])
    problems = [row for row in rows if "FAILED" in row[2] or "skipped" in row[2]]
    assert not problems, problems
    sections = {row[0] for row in rows}
    assert {"train float16", "train bfloat16", "infer bfloat16", "onnx fp16 (CPU)"} <= sections
    assert {row[1] for row in rows} >= {"mlp", "resnet18", "hf_gpt2"}
    assert all(float(row[3]) > 0 for row in rows)
    variants = {row[2] for row in rows}
    assert {"ours O1", "ours O2 stored weights", "autocast+GradScaler", "ours frozen", "ours+compile", "export_onnx", "convert_onnx"} <= variants
    table = capsys.readouterr().out
    assert "amp-compiler vs torch.autocast on CPU" in table and "dry run" in table
    assert {"compile bfloat16", "infer bfloat16"} <= sections and "vit_b_16" in {row[1] for row in rows}
    floor = [row for row in rows if row[2] == "all low, no cast (floor)"]
    assert floor and all("of autocast" in row[4] for row in floor)
    casts = [row for row in rows if row[0].startswith("infer") and row[2] in ("ours", "autocast")]
    assert casts and all(isinstance(row[5], int) and row[5] > 0 for row in casts)
    assert {"fp8 train", "fp8 infer", "fp8 compile train", "fp8 compile infer"} <= sections
    fp8 = [row for row in rows if row[0].startswith("fp8")]
    assert {"ours bf16 O2 stored weights", "ours fp8 current", "ours fp8 delayed", "ours fp8 rowwise",
            "ours fp8 current frozen", "ours fp8 rowwise frozen", "ours fp8 current + compile"} <= {row[2] for row in fp8}
    assert all("of autocast bf16" in row[4] for row in fp8 if not row[2].startswith("autocast"))
    # the dry run's tiny blocks take the fp8 path (fp8_min_dim=16): every linear, not the bf16 one left as it was
    case, options = gpu.fp8_case(dry_run=True)
    counts = amp_compiler.convert(case.model, "fp8", example_inputs=case.inputs, **options).meta["amp"]["pass_counts"]
    assert counts["lower_fp8_matmuls"] == {"fp8": 4 * len(case.model), "kept": 0}, counts


def test_the_profile_script_dry_run_lists_both_sides_and_their_difference(capsys):
    sys.path.insert(0, str(GPU_SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_profile", GPU_SCRIPT.parent / "gpu_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    profile.main(["mlp", "--dry-run", "--top", "3"])
    out = capsys.readouterr().out
    assert "autocast:" in out and "ours O1:" in out and "ours - autocast" in out
    assert out.count(" calls ") >= 6
