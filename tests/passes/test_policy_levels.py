"""The levels are one data table (amp_compiler/passes/policy/levels.py): every level-dependent choice reads it."""
import argparse
import dataclasses

import onnx
import pytest
import torch

import amp_compiler
from amp_compiler.cli import build_parser
from amp_compiler.config import make_config
from amp_compiler.passes.fx.runtime import is_cast
from amp_compiler.passes.policy import levels
from amp_compiler.passes.policy.levels import LEVELS, Level
from amp_compiler.passes.policy.rules import PrecisionRules
from amp_compiler.train.loss_scale import DynamicLossScaleManager, default_loss_scale_manager
from amp_testing import LinearNormNet


def _float_types(path) -> set[int]:
    model = onnx.load(path)
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    return {v.type.tensor_type.elem_type for v in values} | {t.data_type for t in model.graph.initializer}


def test_o0_keeps_every_op_in_its_policy_class():
    # The trap this table removed: O0 used to classify softmax, exp and cross_entropy as "allow".
    o0, o1 = PrecisionRules.build("O0", "float16"), PrecisionRules.build("O1", "float16")
    for op in ("softmax", "exp", "cross_entropy", "linear"):
        assert o0.classify(op) == o1.classify(op)
    assert o0.classify("softmax")[0] == "deny"


@pytest.mark.slow
def test_o0_paints_nothing_on_fx_and_onnx(tmp_path):
    model, x = LinearNormNet(), torch.randn(2, 8)
    gm = amp_compiler.convert(model, "O0", example_inputs=(x,))
    assert not any(is_cast(n) for n in gm.graph.nodes)
    assert all(n.meta["amp"]["precision"] is None for n in gm.graph.nodes)

    amp_compiler.export_onnx(model, (x,), tmp_path / "o0.onnx", "O0")
    assert onnx.TensorProto.FLOAT16 not in _float_types(tmp_path / "o0.onnx")
    torch.onnx.export(model.eval(), (x,), tmp_path / "fp32.onnx", dynamo=True, verbose=False)
    report = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", tmp_path / "out.onnx", "O0")
    assert report.pass_counts == {} and report.casts == 0
    assert onnx.TensorProto.FLOAT16 not in _float_types(tmp_path / "out.onnx")


def test_a_new_level_is_one_entry(monkeypatch):
    # A level that paints like O2 but keeps norms low and scales no loss: only the table says so.
    monkeypatch.setitem(LEVELS, "O2x", dataclasses.replace(LEVELS["O2"], name="O2x", keep_norm_fp32=False,
                                                          loss_scaling=None))
    config = make_config("O2x")
    assert config.keep_norm_fp32 is False and config.level_spec.paints
    rules = config.precision_rules()
    assert rules.classify("layer_norm")[0] == "allow" and rules.classify("cross_entropy")[0] == "deny"
    assert default_loss_scale_manager("O2x", torch.float16) is None
    assert isinstance(default_loss_scale_manager("O2", torch.float16), DynamicLossScaleManager)
    monkeypatch.setitem(LEVELS, "Ox", Level("Ox", "paints nothing", paints=False, lowers=(), keeps_losses_fp32=True,
                                            keep_norm_fp32=True, loss_scaling=None))
    gm = amp_compiler.convert(LinearNormNet(), "Ox", example_inputs=(torch.randn(2, 8),))
    assert not any(is_cast(n) for n in gm.graph.nodes)


@pytest.mark.parametrize("name", list(LEVELS))
def test_every_level_reads_its_entry(name):
    level = LEVELS[name]
    config = make_config(name)
    assert config.level_spec is level and config.keep_norm_fp32 == level.keep_norm_fp32
    rules = config.precision_rules()
    lowered = rules.classify("softmax")[0] == "allow"
    assert lowered == ("deny" in level.lowers)
    assert (rules.classify("cross_entropy")[0] == "deny") == (not level.lowers or level.keeps_losses_fp32)
    assert (default_loss_scale_manager(name, torch.float16) is not None) == (level.loss_scaling == "dynamic")
    assert levels.level_of(name) is level


def test_the_level_help_says_what_each_level_does():
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    for command in ("explain", "export", "convert-onnx"):
        level_help = next(action.help for action in commands.choices[command]._actions
                          if "--level" in action.option_strings)
        assert all(f"{name}: {level.says}" in level_help for name, level in LEVELS.items()), level_help


def test_mixed_kernel_norms_are_a_table_entry(monkeypatch):
    # O1 runs batch/group norms on low activations with fp32 weights because its entry says so.
    assert LEVELS["O1"].mixed_norms == ("batch_norm", "group_norm") and LEVELS["O0"].mixed_norms == ()
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3))
    x = torch.randn(2, 3, 8, 8)
    batch_norm = lambda gm: {n.meta["amp"]["precision"] for n in gm.graph.nodes  # noqa: E731
                             if n.meta["amp"].get("op") == "batch_norm"}
    assert batch_norm(amp_compiler.convert(net, "O1", example_inputs=(x,))) == {"low"}
    monkeypatch.setitem(LEVELS, "O1", dataclasses.replace(LEVELS["O1"], mixed_norms=()))
    rules = make_config("O1").precision_rules()
    assert rules.classify("batch_norm")[0] == "deny" and not rules.keeps_fp32_weights("batch_norm")
    assert batch_norm(amp_compiler.convert(net, "O1", example_inputs=(x,))) == {"fp32"}
