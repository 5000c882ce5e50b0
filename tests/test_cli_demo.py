"""`amp-compiler demo`: the quick start's main job."""
from amp_compiler.cli import main


def test_demo_converts_reports_compares_and_trains(capsys, tmp_path):
    html = tmp_path / "mlp.html"
    assert main(["demo", "--model", "mlp", "--steps", "3", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "level O1" in out and "leaf modules kept whole" in out and "nodes: " in out
    assert "rows, by module" not in out and "totals:" not in out          # the summary, not the table
    assert f"graph and rules of all " in out and str(html.resolve()) in out and html.stat().st_size > 10_000
    assert "casts inserted:" in out and "max |mixed - fp32|" in out
    assert out.count("loss scale") == 3 and "skipped steps:" in out


def test_demo_unknown_model_is_a_clear_error(capsys):
    assert main(["demo", "--model", "nope", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "mlp" in err
