"""convert(model, inplace=True): the user's model object, converted on TorchDynamo's capture on its first calls.

What the user keeps (class, methods, signature, state_dict, hooks, train/eval, Python state the forward reads),
what runs (the same outputs and decisions as convert(), low at run time, training like fp32), and the
conversion's life cycle (restore, converting again, deepcopy, torch.save, assign loads, example inputs,
calibration). tests/dynamo/test_in_place_dynamo.py has what only dynamo's capture does (graph breaks, recompile limits,
generate, fallbacks).
"""
from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record
from amp_compiler.passes.node_facts import facts
from amp_testing import ProfiledDtypes
from models import ZOO_NAMES, build

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def decisions(*gms) -> dict:
    """(module path, op) -> the precisions its nodes were given, over the graphs `gms`. nn.Identity left out:
    dynamo's graph has no node for it (fx keeps its call)."""
    found: dict = {}
    for gm in gms:
        for node in gm.graph.nodes:
            if facts(node).get("precision") is not None and facts(node).get("op") != "identity":
                found.setdefault((facts(node).get("module"), facts(node).get("op")), set()).add(
                    facts(node)["precision"])
    return found


def linear_precisions(model) -> list:
    return [facts(n).get("precision") for gm in graphs(model) for n in gm.graph.nodes
            if facts(n).get("op") == "linear"]


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, scale: float = 1.0, *, gate=None):
        h = self.down(torch.relu(self.up(self.norm(x)))) * scale
        return x + (h if gate is None else h * gate)

    def describe(self):   # a custom method must survive the conversion
        return "block"


class Opaque:
    """An argument no fx graph can take (like a KV cache object)."""
    def __init__(self, value):
        self.value = value


class TakesObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.block = Block()

    def forward(self, x, state: Opaque):
        return self.block(self.proj(x)) * state.value


def test_same_object_class_signature_methods_and_state_dict():
    torch.manual_seed(0)
    model = Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    signature = inspect.signature(model.forward)
    result = amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    assert result is model and type(model) is Block and model.describe() == "block"
    assert inspect.signature(model.forward) == signature
    model(torch.randn(4, 16))
    assert graphs(model)   # the call was the converted one
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    assert [name for name, _ in model.named_modules()] == ["", "norm", "up", "down"]   # nothing registered


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_outputs_and_decisions_equal_convert(name):
    task = build(name, size="small", seed=0)
    task.model.eval()   # dropout off: both runs are deterministic
    # a graph is converted on the inputs it gets: the reference knows them too (shape-aware passes see the same)
    reference = amp_compiler.convert(copy.deepcopy(task.model), "O1", dtype=BF16, example_inputs=task.example_inputs)
    model = amp_compiler.convert(task.model, "O1", dtype=BF16, inplace=True)
    with torch.no_grad():
        assert torch.equal(model(*task.example_inputs), reference(*task.example_inputs))
    (graph,) = graphs(model)
    # each node's decision, by the user's module and op. (The parts compared meta["amp"]["casts"]: dynamo's graph
    # is another graph of the same model, with norms as functions of their buffers instead of leaf modules, so
    # its cast count differs where the decisions and outputs do not: resnet, 34 casts to convert()'s 10.)
    assert decisions(graph) == decisions(reference)
    assert "low" in set().union(*decisions(graph).values())


def test_runs_low_at_run_time_and_trains_like_fp32():
    torch.manual_seed(0)
    model = Block()
    fp32 = copy.deepcopy(model)
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    x = torch.randn(8, 16)
    model(x)   # compiles (the profiler would also record the fake ops of dynamo's tracing)
    with ProfiledDtypes() as recorder:
        loss = model(x).square().mean()
    assert recorder.input_dtypes("addmm") == {BF16}, recorder.calls
    assert recorder.input_dtypes("native_layer_norm") == {torch.float32}, recorder.calls
    loss.backward()
    fp32(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.allclose(p.grad, q.grad, rtol=0.05, atol=5e-3), name


def test_a_python_object_argument_still_runs_low():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(2.0))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    model(x, Opaque(2.0))   # compiles
    with ProfiledDtypes() as recorder:
        out = model(x, Opaque(2.0))
    assert torch.allclose(out, expected, rtol=0.02, atol=0.05)
    assert recorder.input_dtypes("addmm") == {BF16}, recorder.calls
    precisions = linear_precisions(model)
    assert len(precisions) == 3 and set(precisions) == {"low"}, precisions   # proj, block.up, block.down


def test_hooks_fire_once_per_call():
    model = Block()
    calls = []
    model.register_forward_hook(lambda m, i, o: calls.append("root"))
    model.up.register_forward_pre_hook(lambda m, i: calls.append(("up", i[0].dtype)))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    model(torch.randn(4, 16))
    model(torch.randn(4, 16))
    assert graphs(model)
    assert calls.count("root") == 2 and sum(1 for c in calls if c[0] == "up") == 2


class TrainingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        y = self.proj(x)
        return y * 0.5 if self.training else y


def test_train_and_eval_each_get_their_own_graph():
    model = amp_compiler.convert(TrainingBranch(), "O1", dtype=BF16, inplace=True)
    x = torch.randn(4, 16)
    train_out = model(x)
    model.eval()
    eval_out = model(x)
    assert torch.allclose(eval_out, 2 * train_out, atol=1e-6)
    model.train()
    assert torch.equal(model(x), train_out)
    assert len(graphs(model)) == 2   # dynamo guards on the training flag: the train graph is reused


class Settings:
    def __init__(self):
        self.negate = False


class ReadsSettings(Block):
    def __init__(self, settings):
        super().__init__()
        self.settings = settings

    def forward(self, x):
        y = super().forward(x)
        return -y if self.settings.negate else y


def test_a_shared_settings_object_changed_after_a_call_is_followed():
    """(from test_in_place_reuse.py, where a reused template had to see it too.) A plain Python object the forward
    reads, changed between calls: the next call follows it, as the model as written does."""
    settings = Settings()
    torch.manual_seed(0)
    model = nn.Sequential(ReadsSettings(settings), ReadsSettings(settings)).eval()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        before = model(x)
        settings.negate = True
        out = model(x)
        reference = nn.Sequential.forward(model, x)   # the class's forward: as written, fp32
    assert len(graphs(model)) == 2
    assert not torch.allclose(out, before, atol=0.1)
    assert (out * reference > 0).float().mean() > 0.95   # negated like the fp32 result, low precision aside
    assert torch.allclose(out, reference, rtol=0.05, atol=0.05)


def test_restore_gives_back_the_original_forwards():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(1.0))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    assert not torch.equal(model(x, Opaque(1.0)), expected)
    assert amp_compiler.restore(model) is model
    assert torch.equal(model(x, Opaque(1.0)), expected)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert compiled_record(model) is None and graphs(model) == []
    with pytest.raises(TypeError, match="inplace=True"):
        amp_compiler.restore(model)


def test_converting_twice_and_dynamic_shapes_are_refused():
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True)
    with pytest.raises(ValueError, match="already converted in place \\(level O1\\); call amp_compiler.restore"):
        amp_compiler.convert(model, "O2", inplace=True)   # would silently replace the first conversion
    amp_compiler.restore(model)
    assert "forward" not in model.__dict__ and compiled_record(model) is None
    assert amp_compiler.convert(model, "O2", inplace=True) is model   # after restore: converted again
    with pytest.raises(ValueError, match="dynamic_shapes"):
        amp_compiler.convert(Block(), "O1", inplace=True, dynamic_shapes={"x": {0: "batch"}})


def test_a_new_weight_loaded_with_assign_is_the_one_the_graph_reads():
    torch.manual_seed(0)
    model, other = Block(), Block()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    x = torch.randn(4, 16)
    model(x)
    with torch.no_grad():
        model(x)   # an inference graph too: its weight cache holds the old weights' low copies
    model.load_state_dict(other.state_dict(), assign=True)
    assert torch.allclose(model(x), other(x), rtol=0.02, atol=0.02)
    assert not torch.allclose(model(x), Block.forward(Block(), x), atol=0.02)
    with torch.no_grad():
        assert torch.allclose(model(x), other(x), rtol=0.02, atol=0.02)


def test_deepcopy_and_torch_save_keep_a_working_conversion():
    torch.manual_seed(0)
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True)
    x = torch.randn(4, 16)
    out = model(x)
    twin = copy.deepcopy(model)
    assert torch.equal(twin(x), out)
    with torch.no_grad():
        twin.up.weight.zero_()   # the copy has its own tensors: the original's graph does not see this
    assert torch.equal(model(x), out) and not torch.equal(twin(x), out)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is Block and graphs(loaded) == []   # saved without graphs: compiled again on its first call
    assert torch.equal(loaded(x), out)
    assert len(graphs(loaded)) == 1 and set(linear_precisions(loaded)) == {"low"}


def test_example_inputs_capture_at_conversion_without_changing_buffers():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).train()
    statistics = model[1].running_mean.clone()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, example_inputs=(torch.randn(16, 8) + 3,))
    assert len(graphs(model)) == 1
    assert torch.equal(model[1].running_mean, statistics) and model[1].num_batches_tracked == 0


def test_calibration_data_reaches_the_graphs():
    torch.manual_seed(0)
    model = Block()
    samples = [(torch.randn(4, 16),), (torch.randn(4, 16) * 3,)]
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, calibration_data=samples)
    model(torch.randn(4, 16))
    assert graphs(model)
    assert any("range" in facts(node) for gm in graphs(model) for node in gm.graph.nodes)
    with pytest.raises(ValueError, match="sample 0"):
        amp_compiler.convert(Block(), "O1", inplace=True, calibration_data=[(torch.randn(4, 5),)])


def test_o0_changes_nothing():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(1.5))
    amp_compiler.convert(model, "O0", inplace=True)
    assert torch.equal(model(x, Opaque(1.5)), expected)
    assert graphs(model) and decisions(*graphs(model)) == {}   # O0 paints nothing


def test_a_submodule_switched_alone_to_eval_is_followed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)
    x = torch.randn(4, 16)
    model(x)
    model[1].eval()   # the root is still in train mode
    torch.manual_seed(1)
    assert torch.equal(model(x), model(x))   # no dropout any more
    assert torch.allclose(model(x), nn.Sequential.forward(model, x), rtol=0.02, atol=0.02)
    assert len(graphs(model)) == 2


def test_a_wrapper_put_on_the_forward_after_conversion_still_reaches_the_compiled_forward():
    # Accelerate's prepare() wraps model.forward; the compiled forward has no __func__, so it wraps the callable
    # itself (accelerator.py: `if not hasattr(model.forward, "__func__")`), as here
    model = amp_compiler.convert(nn.Linear(16, 16), "O1", dtype=BF16, inplace=True)
    assert not hasattr(model.forward, "__func__")
    wrapped = model.forward
    model.forward = lambda *args: wrapped(*args) + 0
    x = torch.randn(4, 16)
    model(x)   # compiles
    with ProfiledDtypes() as recorder:
        out = model(x)
    assert len(graphs(model)) == 1 and recorder.input_dtypes("addmm") == {BF16}, recorder.calls
    assert torch.allclose(out, nn.Linear.forward(model, x), rtol=0.02, atol=0.02)
