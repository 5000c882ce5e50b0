"""The export / convert-onnx subcommands as amp_compiler/cli mounts them."""
import argparse

import numpy as np
import onnx
import pytest
from onnx import helper

from amp_compiler.cli.onnx_commands import add_convert_onnx_parser, add_export_parser
from onnx_testing import F32, assert_valid, initializer, make_model, save, tensor_input


@pytest.fixture
def cli():
    parser = argparse.ArgumentParser(prog="amp-compiler")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_export_parser(subparsers)
    add_convert_onnx_parser(subparsers)

    def main(*argv):
        args = parser.parse_args([str(a) for a in argv])
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


def test_export_builds_the_factory_and_validates(cli, tmp_path, capsys):
    dst = tmp_path / "mlp.onnx"
    assert cli("export", "models:build", dst, "--kwarg", "name=mlp", "--kwarg", "size='small'", "--validate") == 0
    assert_valid(str(dst))
    assert "passed" in capsys.readouterr().out
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in onnx.load(str(dst)).graph.initializer)


@pytest.mark.parametrize("argv, message", [
    (("convert-onnx", "{tmp}/absent.onnx", "{tmp}/o.onnx"), "absent.onnx: no such ONNX file"),
    (("convert-onnx", "{model}", "{tmp}/o.onnx", "--level", "O9"), "got 'O9'"),
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


def test_export_of_a_bare_module_takes_input_shapes(cli, tmp_path):
    dst = tmp_path / "linear.onnx"
    assert cli("export", "torch.nn:Linear", dst, "--kwarg", "in_features=4", "--kwarg", "out_features=2",
               "--input-shape", "3,4") == 0
    assert_valid(str(dst))
