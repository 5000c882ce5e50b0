"""issue 17: the user's hooks keep firing on the converted module, and `self.training` branches follow train()/eval()."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler import HookWarning

BF16, FP16 = torch.bfloat16, torch.float16
TOLERANCE = {BF16: 2e-2, FP16: 4e-3}


def relative_error(value, reference) -> float:
    return ((value.float() - reference).norm() / reference.norm()).item()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.norm(self.fc(x))))


def hooked_net(calls: list, grads: list) -> Net:
    torch.manual_seed(0)
    net = Net()
    net.fc.register_forward_pre_hook(lambda module, args: (calls.append("fc pre"), (args[0] * 2,))[1])
    net.fc.register_forward_hook(lambda module, args, output: (calls.append("fc forward"), output * 3)[1])
    net.fc.register_full_backward_hook(
        lambda module, grad_in, grad_out: (calls.append("fc backward"), grads.append(grad_out[0].float()))[0])
    net.norm.register_forward_hook(lambda module, args, output: calls.append("norm forward"))
    net.block.register_forward_hook(lambda module, args, output: (calls.append("block forward"), output - 1)[1])
    net.register_forward_hook(lambda module, args, output: calls.append("model forward"))
    return net


def run(module, x, calls: list) -> tuple:
    calls.clear()
    x = x.clone().requires_grad_()
    out = module(x)
    out.float().square().sum().backward()
    return out, x.grad, list(calls)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_hooks_fire_on_the_converted_module_as_on_the_model(dtype):
    """A lowered Linear kept its hooks (forward, pre, backward), like a LayerNorm, a traced block and the model."""
    calls: list = []
    grads: list = []
    net = hooked_net(calls, grads)
    x = torch.randn(8, 16)
    reference, reference_grad, reference_calls = run(net, x, calls)
    calls.clear()
    gm = amp_compiler.convert(net, "O1", dtype=dtype, example_inputs=(x,))
    assert calls == [], f"convert() fired the user's hooks: {calls}"
    out, grad, gm_calls = run(gm, x, calls)
    assert sorted(gm_calls) == sorted(reference_calls)
    assert len(grads) == 2 and relative_error(grads[1], grads[0]) < TOLERANCE[dtype]   # what the backward hook saw
    assert relative_error(out, reference) < TOLERANCE[dtype]
    assert relative_error(grad, reference_grad) < TOLERANCE[dtype]
    summary = amp_compiler.explain(gm).summary_lines()
    assert "hooks: fc (forward pre-hook, forward hook, backward hook): fire: the graph calls the module " \
           "(its parameters cast for the call)" in summary
    assert any(line.startswith("hooks: block (forward hook): fire") for line in summary)
    assert any(line.startswith("hooks: (the model) (forward hook): fire") for line in summary)
    assert net.fc._forward_hooks and type(net.fc) is nn.Linear   # the model keeps its own hooks


def test_hooks_fire_on_every_call_not_once_at_capture():
    counts = {"fc": 0, "block": 0}
    torch.manual_seed(0)
    net = Net()
    net.fc.register_forward_hook(lambda *_: counts.__setitem__("fc", counts["fc"] + 1))
    net.block.register_forward_hook(lambda *_: counts.__setitem__("block", counts["block"] + 1))
    gm = amp_compiler.convert(net, "O1", dtype=BF16)
    assert counts == {"fc": 0, "block": 0}
    for _ in range(3):
        gm(torch.randn(2, 16))
    assert counts == {"fc": 3, "block": 3}


def test_global_hooks_warn_naming_the_modules_they_miss():
    torch.manual_seed(0)
    net, seen = Net(), []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(module))
    try:
        with pytest.warns(HookWarning, match=r"global module hooks \(forward hook\).* \(norm\), not for block, block.fc, fc, head"):
            gm = amp_compiler.convert(net, "O1", dtype=BF16, example_inputs=(torch.randn(2, 16),))
        assert seen == [], "a global hook fired during convert()"
        gm(torch.randn(2, 16))
    finally:
        handle.remove()
    assert [type(m).__name__ for m in seen] == ["LayerNorm", "NetAmp"]   # the modules the graph calls, and itself


def test_without_hooks_linear_layers_are_still_lowered():
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookWarning)
        gm = amp_compiler.convert(Net(), "O1", dtype=BF16)
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("fc", "head")]
    assert "hooks:" not in str(amp_compiler.explain(gm))


class Branchy(nn.Module):
    """Branches on self.training by hand, and passes it to a functional dropout (as HF models do)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h * 2
        return self.head(F.dropout(h, 0.5, training=self.training))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Branchy()

    def forward(self, x):
        return self.encoder(x)


@pytest.mark.slow
@pytest.mark.parametrize("captured_in", ["eval", "train"])
def test_a_training_branch_follows_train_and_eval(captured_in):
    torch.manual_seed(0)
    model = Wrapper().train(captured_in == "train")
    x = torch.randn(64, 16)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    for mode in ("eval", "train", "eval", "train"):
        gm.train(mode == "train")
        model.train(mode == "train")
        torch.manual_seed(1)
        out = gm(x)
        torch.manual_seed(1)
        reference = model(x)
        assert relative_error(out, reference) < TOLERANCE[BF16], f"{mode} after capture in {captured_in}"
        line = next(line for line in amp_compiler.explain(gm).summary_lines() if line.startswith("training:"))
        assert "encoder" in line and f"the {mode}-mode one" in line
    assert len(type(gm)._amp_graphs) == 2     # each mode captured once
    assert gm.meta["amp"]["training_reads"] == {"encoder": True}
    assert model.training and type(model.encoder) is Branchy   # the model is untouched


def test_a_copy_of_the_converted_module_follows_train_too():
    torch.manual_seed(0)
    model = Wrapper().eval()
    x = torch.randn(64, 16)
    gm = copy.deepcopy(amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))).train()
    model.train()
    torch.manual_seed(1)
    out = gm(x)
    torch.manual_seed(1)
    assert relative_error(out, model(x)) < TOLERANCE[BF16]


def test_models_that_do_not_read_training_keep_one_graph():
    gm = amp_compiler.convert(Net().eval(), "O1", dtype=BF16)
    assert not gm.meta["amp"].get("training_reads")
    graph = gm.graph
    gm.train()(torch.randn(2, 16))
    assert gm.graph is graph


def test_hooks_the_export_front_end_inlines_are_named():
    class ShapeBranch(nn.Module):   # fx cannot trace the branch on a shape: torch.export captures it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x * 2 if x.shape[0] > 2 else x)

    model = ShapeBranch()
    model.fc.register_forward_hook(lambda module, args, output: output * 3)
    x = torch.randn(8, 16)
    with pytest.warns(HookWarning, match="forward hook on fc: torch.export ran it once at capture"):
        gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    assert gm.meta["amp"]["frontend"] == "torch.export"
    assert relative_error(gm(x), model(x)) < TOLERANCE[BF16]   # its tensor operations are in the graph
    assert any("DO NOT FIRE" in line for line in amp_compiler.explain(gm).summary_lines())


class TrainingScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if self.training else h


@pytest.mark.slow
def test_a_compiled_converted_module_follows_train_and_eval():
    torch.manual_seed(0)
    model, x = TrainingScale().eval(), torch.randn(8, 16)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    compiled = torch.compile(gm)
    for mode in (False, True, False):
        gm.train(mode)
        model.train(mode)
        assert relative_error(compiled(x), model(x)) < TOLERANCE[BF16], f"training={mode}"


def test_a_saved_converted_module_refuses_the_mode_it_did_not_capture(tmp_path):
    # torch.save keeps one mode's code: a loaded module called in the other mode must not run it silently.
    torch.manual_seed(0)
    model = Wrapper().eval()
    x = torch.randn(8, 16)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    torch.save(gm, tmp_path / "gm.pt")
    loaded = torch.load(tmp_path / "gm.pt", weights_only=False)
    assert relative_error(loaded(x), model(x)) < TOLERANCE[BF16]
    loaded.train()
    with pytest.raises(RuntimeError, match=r"model\.encoder read self\.training \(False\)"):
        loaded(x)
    loaded.eval()
    assert relative_error(loaded(x), model(x)) < TOLERANCE[BF16]


def test_hooks_registered_while_capture_silences_hooks_are_kept():
    # A profiler's global hook, or a hook another thread adds while convert() runs, must survive the capture.
    from torch.nn.modules import module as module_globals

    from amp_compiler.frontend.hooks import user_hooks_silenced

    linear = nn.Linear(2, 2)
    kept = linear.register_forward_hook(lambda *args: None)
    with user_hooks_silenced(linear):
        assert not linear._forward_hooks
        handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
        linear.register_forward_hook(lambda *args: None)
    try:
        assert len(linear._forward_hooks) == 2 and kept.id in linear._forward_hooks
        assert handle.id in module_globals._global_forward_hooks
    finally:
        handle.remove()


def test_recording_training_reads_runs_no_init_subclass_of_the_users():
    # The capture-time subclass that records `training` reads must not enter a user's class registry.
    registry = {}

    class Registered(nn.Module):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            registry[cls.__name__] = cls

    class Block(Registered):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * (2 if self.training else 1)

    before = registry["Block"]
    gm = amp_compiler.convert(nn.Sequential(Block()).eval(), "O1", dtype=BF16)
    assert registry["Block"] is before and "__init_subclass__" not in Block.__dict__
    assert gm.meta["amp"]["training_reads"] == {"0": False}   # still recorded
