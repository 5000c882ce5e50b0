"""amp-compiler explain / compare / render / --version, and how MODULE:FACTORY is found."""
import os
import textwrap

import pytest

import amp_compiler
from amp_compiler.cli import main

FACTORY = textwrap.dedent('''
    import torch
    from torch import nn


    class Planted(nn.Module):
        """An activation scaled by 1e5 between two matmuls: inf in float16, fine in bfloat16."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.b(self.a(x) * 400 * 250), -1)


    def planted(batch=4):
        torch.manual_seed(0)
        return Planted(), (torch.randn(batch, 8),)


    def with_samples():
        torch.manual_seed(1)
        return Planted(), torch.randn(4, 8), [(torch.randn(4, 8),) for _ in range(3)]


    def not_a_pair():
        return 3
''')


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    (tmp_path / "cli_factories.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "cli_factories", raising=False)
    return tmp_path


def test_explain_prints_the_summary_and_says_where_the_picture_went(factory_dir, capsys):
    assert main(["explain", "cli_factories:planted", "--html", "g.html"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("amp-compiler report: level O1 (asked O1), float16")
    assert "rows: --table prints them" in out and "by module" not in out
    assert f"graph written to {factory_dir / 'g.html'}" in out and (factory_dir / "g.html").stat().st_size > 10_000


@pytest.mark.slow
def test_explain_filters_and_options_reach_convert(factory_dir, capsys):
    assert main(["explain", "cli_factories:planted", "--only", "fp32"]) == 0
    out = capsys.readouterr().out
    rows = out[out.index("rows (only='fp32')"):].splitlines()
    assert "1 of 11 rows (only='fp32')" in out and rows[2].split()[:3] == ["softmax", "softmax", "float32"]
    assert main(["explain", "cli_factories:planted", "--level", "O2", "--dtype", "bf16", "--only", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "level O2 (asked O2), bfloat16" in out and "0 of 11 rows (only='fp32')" in out   # O2: softmax too
    assert main(["explain", "cli_factories:planted", "--table"]) == 0
    assert "11 rows, by module" in capsys.readouterr().out


def test_compare_exits_1_where_fp16_overflows_and_0_where_bf16_holds_it(factory_dir, capsys):
    assert main(["compare", str(factory_dir / "cli_factories.py") + ":planted"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "first node past tolerance: mul_1 (mul) float16" in out
    assert main(["compare", "cli_factories:planted", "--dtype", "bfloat16", "--kwarg", "batch=2"]) == 0
    assert "passed" in capsys.readouterr().out


def test_calibrate_runs_the_ranges_on_the_factorys_samples(factory_dir, capsys):
    assert main(["compare", "cli_factories:with_samples", "--calibrate"]) == 0       # 1e5 kept fp32: passes
    out = capsys.readouterr().out
    assert "passed" in out and "range calibration on the example inputs" not in out
    assert main(["explain", "cli_factories:planted", "--calibrate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("range calibration on the example inputs alone")
    assert "range calibration (1 sample): 2 nodes kept fp32: mul_1, b" in out


@pytest.mark.slow
def test_render_draws_an_onnx_file_and_a_factory(factory_dir, capsys):
    import torch
    model, inputs = __import__("cli_factories").planted()
    amp_compiler.export_onnx(model, inputs, factory_dir / "planted.onnx", dtype=torch.bfloat16)
    assert main(["render", "planted.onnx", "onnx.html"]) == 0
    assert main(["render", "cli_factories:planted", "fx.html", "--level", "O2"]) == 0
    out = capsys.readouterr().out
    assert out.count("graph written to") == 2
    onnx_page, fx_page = ((factory_dir / page).read_text() for page in ("onnx.html", "fx.html"))
    assert "<title>planted.onnx: amp-compiler precision graph</title>" in onnx_page and "bfloat16" in onnx_page
    assert "<title>Planted: amp-compiler precision graph</title>" in fx_page and "O2 (asked O2), float16" in fx_page


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"amp-compiler {amp_compiler.__version__}"


@pytest.mark.parametrize("spec,message", [
    ("nowhere_module:make", "cannot import module 'nowhere_module': looked in the current directory ({cwd})"),
    ("cli_factories:missing", "has no function 'missing'; it defines: Planted, not_a_pair, planted, with_samples"),
    ("cli_factories:not_a_pair", "cli_factories:not_a_pair returned int; a factory returns (model, example_inputs)"),
    ("no/such/file.py:make", "cannot load no/such/file.py: no such file (looked for {cwd}"),
    ("just_a_name", "expected MODULE:FACTORY"),
])
def test_a_factory_that_cannot_be_loaded_says_where_it_looked(factory_dir, capsys, spec, message):
    assert main(["explain", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-compiler explain: error: ") and message.format(cwd=os.getcwd()) in err


GPT = ["models:build", "--kwarg", "name=gpt"]


def test_compare_at_fp8_takes_the_fp8_options_and_the_fp8_default(capsys):
    """--level fp8 runs bf16 around the matmuls without --dtype (the CLI's float16 default is refused there);
    --fp8-min-dim 16 lowers the zoo GPT's 13 matmuls, and the default tolerance follows."""
    assert main(["compare", *GPT, "--level", "fp8", "--fp8-min-dim", "16"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("compare (bfloat16 graph against fp32)")
    assert "tolerance 0.15 of each value's scale (fp8 default: 13 matmuls run in float8, 4 kept bfloat16): passed" in first
    assert main(["compare", *GPT, "--level", "fp8", "--fp8-min-dim", "16", "--rtol", "0.01"]) == 1   # explicit wins
    assert main(["compare", *GPT, "--level", "fp8"]) == 0     # fp8_min_dim 1024: nothing lowered, bf16's default
    assert "(bfloat16 default, level fp8 lowered no matmul to float8)" in capsys.readouterr().out


def test_explain_passes_every_fp8_option_to_convert(capsys):
    argv = ["explain", *GPT, "--level", "fp8", "--fp8-min-dim", "16", "--fp8-keep", "layers.0.*,lm_head",
            "--fp8-keep", "layers.1.attention.query", "--fp8-scaling", "delayed", "--fp8-history", "4",
            "--fp8-amax-from", "most_recent", "--fp8-margin", "1", "--op", "linear"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  linear")]
    kept = [row.split()[0] for row in rows if "kept bfloat16: user rule: fp8_keep" in row]
    assert kept == ["linear", "linear_1", "linear_2", "linear_3", "linear_4", "linear_5", "linear_6", "linear_12"]
    lowered = [row for row in rows if " fp8 (" in row]
    assert len(lowered) == 5 and all("delayed scaling (most_recent of 4 calls' amax)" in row and "margin 1" in row
                                     for row in lowered)


def test_fp8_max_error_reaches_calibration(capsys):
    """--calibrate measures each matmul's fp8 round-trip error; a max error below e4m3's keeps them all bf16."""
    argv = ["explain", *GPT, "--level", "fp8", "--fp8-min-dim", "16", "--calibrate", "--op", "linear"]
    assert main([*argv, "--fp8-max-error", "1e-4"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  linear")]   # layers.1 folds into layers.0
    assert "layers.1: same decisions as layers.0" in out and len(rows) == 7
    assert all("(per tensor, 1 samples) > fp8_max_error 0.0001" in row and " fp8 (" not in row for row in rows)
    assert main([*argv, "--fp8-max-error", "0.5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  linear")]
    assert len(rows) == 7 and all(" fp8 (" in row and "kept" not in row for row in rows)


@pytest.mark.parametrize("argv, message", [
    (["--fp8-min-dim", "16"], "['--fp8-min-dim'] apply to level 'fp8' only, not 'O1'"),
    (["--level", "fp8", "--fp8-history", "4"], "['--fp8-history'] apply to --fp8-scaling='delayed' only, not 'current'"),
    (["--level", "fp8", "--fp8-margin", "-1"], "--fp8-margin must be an int >= 0, got -1"),
    (["--level", "fp8", "--fp8-min-dim", "16", "--fp8-keep", "nowhere.*"], "--fp8-keep pattern(s) ['nowhere.*'] matched"),
    (["--level", "fp8", "--fp8-max-error", "0.1"], "--fp8-max-error applies with --calibrate"),
    (["--level", "fp8", "--dtype", "fp16"], "give --dtype bfloat16 or none; got float16"),
])
def test_fp8_usage_errors_exit_2_in_the_command_lines_words(capsys, argv, message):
    assert main(["explain", *GPT, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-compiler explain: error: ") and message in err and err.count("\n") == 1


def test_a_bad_fp8_choice_is_argparses_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", *GPT, "--level", "fp8", "--fp8-scaling", "blockwise"])
    assert exit_.value.code == 2 and "invalid choice: 'blockwise'" in capsys.readouterr().err
