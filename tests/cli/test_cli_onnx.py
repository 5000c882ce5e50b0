"""The export / convert-onnx subcommands as amp_compiler/cli mounts them."""

import numpy as np
import onnx
import pytest
from onnx import helper

from amp_compiler.cli.arguments import CommandLineParser
from amp_compiler.cli.onnx_commands import add_convert_onnx_parser, add_export_parser
from onnx_testing import F32, assert_valid, initializer, make_model, save, tensor_input


@pytest.fixture
def cli():
    parser = CommandLineParser(prog="amp-compiler")   # a usage error is one line, as amp_compiler.cli's
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_export_parser(subparsers)
    add_convert_onnx_parser(subparsers)

    def main(*argv):
        try:
            args = parser.parse_args([str(a) for a in argv])
        except SystemExit as exit_:     # a bad flag value: argparse's exit, code 2
            return exit_.code
        return args.func(args)
    return main


def small_model():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Softmax", ["h"], ["y"], axis=-1, name="softmax")]
    return make_model(nodes, [tensor_input("x", F32, [2, 4])], [tensor_input("y", F32, [2, 4])],
                      [initializer("w", np.ones((4, 4), np.float32))])


def test_convert_onnx_writes_a_valid_model_and_prints_the_summary(cli, tmp_path, capsys):
    src, dst = save(small_model(), tmp_path, "m.onnx"), tmp_path / "m16.onnx"
    assert cli("convert-onnx", src, dst, "--level", "O2", "--op-block-list", "MatMul", "--table") == 0
    assert_valid(str(dst))
    printed = capsys.readouterr().out
    assert "level O2" in printed and "op_block_list: MatMul" in printed


@pytest.mark.slow
def test_export_builds_the_factory_and_validates(cli, tmp_path, capsys):
    dst = tmp_path / "mlp.onnx"
    assert cli("export", "models:build", dst, "--kwarg", "name=mlp", "--kwarg", "size='small'", "--validate") == 0
    assert_valid(str(dst))
    assert "passed" in capsys.readouterr().out
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in onnx.load(str(dst)).graph.initializer)


@pytest.mark.parametrize("argv, message", [
    (("convert-onnx", "{tmp}/absent.onnx", "{tmp}/o.onnx"), "absent.onnx: no such ONNX file"),
    (("convert-onnx", "{model}", "{tmp}/o.onnx", "--level", "O9"), "argument --level: unknown level 'O9'"),
    (("export", "models:no_such_factory", "{tmp}/o.onnx"), "has no function 'no_such_factory'"),
    (("export", "models", "{tmp}/o.onnx"), "expected MODULE:FACTORY"),
    (("export", "torch.nn:Linear", "{tmp}/o.onnx", "--kwarg", "in_features=2", "--kwarg", "out_features=2"),
     "give its example inputs with --input-shape"),
])
def test_usage_errors_exit_2_with_one_line(cli, tmp_path, capsys, argv, message):
    model = save(small_model(), tmp_path, "m.onnx")
    assert cli(*(a.format(tmp=tmp_path, model=model) for a in argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_export_of_a_bare_module_takes_input_shapes(cli, tmp_path):
    dst = tmp_path / "linear.onnx"
    assert cli("export", "torch.nn:Linear", dst, "--kwarg", "in_features=4", "--kwarg", "out_features=2",
               "--input-shape", "3,4") == 0
    assert_valid(str(dst))


def float8_weights(path) -> list[str]:
    return [t.name for t in onnx.load(str(path)).graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]


def test_export_at_fp8_takes_the_fp8_options_and_validates_at_the_fp8_default(cli, tmp_path, capsys):
    """The zoo MLP's 2 linears that qualify at --fp8-min-dim 16 are stored in float8; --fp8-keep keeps one in
    float16. --validate judges a float8 file at 0.15 (e4m3's error, 0.07 here), --rtol overrides it."""
    dst = tmp_path / "mlp_fp8.onnx"
    base = ("export", "models:build", dst, "--kwarg", "name=mlp", "--level", "fp8", "--fp8-min-dim", "16")
    assert cli(*base, "--validate") == 0
    assert_valid(str(dst))
    assert len(float8_weights(dst)) == 2
    out = capsys.readouterr().out
    assert "tolerance 0.15 of each value's scale + 0.01 (fp8 default: 2 float8 weights, 2 QuantizeLinear to float8): " \
           "passed" in out
    assert cli(*base, "--validate", "--rtol", "0.01") == 1
    assert "tolerance 0.01 of each value's scale + 0.01: FAILED" in capsys.readouterr().out
    assert cli(*base, "--fp8-keep", "layers.0", "--calibrate", "--fp8-max-error", "0.5") == 0
    assert len(float8_weights(dst)) == 1
    assert "range calibration on the example inputs alone" in capsys.readouterr().out


def wide_model():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    weight = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    return make_model(nodes, [tensor_input("x", F32, [4, 32])], [tensor_input("y", F32, [4, 32])],
                      [initializer("w", weight)], opset=21)


def test_convert_onnx_at_fp8_takes_the_fp8_options(cli, tmp_path, capsys):
    src, dst = save(wide_model(), tmp_path, "wide.onnx"), tmp_path / "wide_fp8.onnx"
    assert cli("convert-onnx", src, dst, "--level", "fp8") == 0        # 32 < fp8_min_dim 1024: stays float16
    assert float8_weights(dst) == []
    assert cli("convert-onnx", src, dst, "--level", "fp8", "--fp8-min-dim", "16", "--fp8-margin", "1") == 0
    assert_valid(str(dst))
    assert len(float8_weights(dst)) == 1


@pytest.mark.parametrize("argv, message", [
    (("convert-onnx", "{wide}", "{tmp}/o.onnx", "--level", "fp8", "--fp8-scaling", "delayed"),
     "--fp8-scaling='delayed' has no ONNX form"),
    (("convert-onnx", "{wide}", "{tmp}/o.onnx", "--fp8-min-dim", "16"), "['--fp8-min-dim'] apply to level 'fp8' only"),
    (("export", "models:build", "{tmp}/o.onnx", "--kwarg", "name=mlp", "--level", "fp8", "--fp8-max-error", "0.1"),
     "--fp8-max-error applies with --calibrate"),
])
def test_fp8_usage_errors_exit_2_in_the_command_lines_words(cli, tmp_path, capsys, argv, message):
    wide = save(wide_model(), tmp_path, "wide.onnx")
    assert cli(*(a.format(tmp=tmp_path, wide=wide) for a in argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_convert_onnx_has_no_fp8_max_error(cli, tmp_path, capsys):
    """convert-onnx calibrates nothing: the option would change nothing, so it is not offered."""
    assert cli("convert-onnx", save(wide_model(), tmp_path, "wide.onnx"), tmp_path / "o.onnx", "--level", "fp8",
               "--fp8-max-error", "0.1") == 2
    assert "unrecognized arguments: --fp8-max-error" in capsys.readouterr().err
