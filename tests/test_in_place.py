"""convert(model, inplace=True, capture="parts"): the user's model object, converted part by part on its first calls.

What the user keeps (class, methods, signature, state_dict, hooks, train/eval), what the parts do (lazy
capture, recapture on another dtype/rank/constant/shape guard, the capture limit, as-written fallbacks with
their children converted), and the conversion's life cycle (restore, deepcopy, torch.save, assign loads).
"""
from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.in_place import CAPTURE_LIMIT, CaptureLimitWarning, in_place_conversion
from amp_testing import AtenDtypeRecorder
from models import ZOO_NAMES, build

BF16 = torch.bfloat16


def parts(model):
    return in_place_conversion(model).parts


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
    """An argument no graph can take (like a KV cache object)."""
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
    result = amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    assert result is model and type(model) is Block and model.describe() == "block"
    assert inspect.signature(model.forward) == signature
    model(torch.randn(4, 16))
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    assert [name for name, _ in model.named_modules()] == ["", "norm", "up", "down"]   # nothing registered


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_outputs_and_decisions_equal_convert(name):
    task = build(name, size="small", seed=0)
    task.model.eval()   # dropout off: both runs are deterministic
    # a part captures on the inputs it gets: the reference knows them too (shape-aware passes see the same)
    reference = amp_compiler.convert(copy.deepcopy(task.model), "O1", dtype=BF16, example_inputs=task.example_inputs)
    model = amp_compiler.convert(task.model, "O1", dtype=BF16, inplace=True, capture="parts")
    with torch.no_grad():
        assert torch.equal(model(*task.example_inputs), reference(*task.example_inputs))
    (graph,) = [g for graphs in parts(model)[""].graphs.values() for g in graphs]
    assert graph.gm.meta["amp"]["casts"] == reference.meta["amp"]["casts"]


def test_runs_low_at_run_time_and_trains_like_fp32():
    torch.manual_seed(0)
    model = Block()
    fp32 = copy.deepcopy(model)
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(8, 16)
    model(x)   # captures (its fake-value propagation would show in the recorder as fp32 ops)
    with AtenDtypeRecorder() as recorder:
        loss = model(x).square().mean()
    assert recorder.input_dtypes("addmm") == {BF16}
    assert recorder.input_dtypes("native_layer_norm") == {torch.float32}
    loss.backward()
    fp32(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.allclose(p.grad, q.grad, rtol=0.05, atol=5e-3), name


def test_lazy_capture_and_recapture_on_dtype_rank_keywords_and_constants():
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True, capture="parts")
    root = parts(model)[""]
    assert root.captures == 0   # nothing until the first call
    model(torch.randn(4, 16))
    model(torch.randn(9, 16))   # another batch size: the same graph (shape-generic)
    assert root.captures == 1
    model(torch.randn(2, 4, 16))                          # rank
    model(torch.randn(4, 16), gate=torch.rand(4, 16))     # keyword
    model(torch.randn(4, 16), 0.5)                        # constant
    model(torch.randn(4, 16).to(torch.float64).float())   # same key again
    assert root.captures == 4 and len(root.graphs) == 4
    x = torch.randn(4, 16)
    expected = Block.forward(model, x, 0.5)   # the class's forward: the model as written, fp32
    assert torch.allclose(model(x, 0.5), expected, atol=0.05)


def test_capture_limit_runs_as_written_with_one_warning():
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for scale in range(CAPTURE_LIMIT + 3):
            out = model(x, float(scale))
    limit = [w for w in caught if issubclass(w.category, CaptureLimitWarning)]
    assert len(limit) == 1 and "Block" in str(limit[0].message)
    assert torch.allclose(out, Block.forward(model, x, float(CAPTURE_LIMIT + 2)), atol=0.1)
    root = parts(model)[""]
    assert root.captures == CAPTURE_LIMIT and any("captured" in r for r in root.as_written.values())
    assert {"norm", "up", "down"} <= set(parts(model))   # its children are converted instead


def test_an_uncapturable_argument_runs_the_part_as_written_and_converts_its_children():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(2.0))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    model(x, Opaque(2.0))   # captures
    with AtenDtypeRecorder() as recorder:
        out = model(x, Opaque(2.0))
    assert torch.allclose(out, expected, rtol=0.02, atol=0.05)
    assert recorder.input_dtypes("addmm") == {BF16}
    reasons = parts(model)[""].as_written
    assert any("Opaque" in reason for reason in reasons.values())
    assert parts(model)["proj"].graphs and parts(model)["block"].graphs


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        if x.sum() > 0:   # fx cannot trace this, and no example inputs were given
            return self.block(x)
        return -self.block(x)


def test_an_untraceable_forward_falls_back_to_its_children():
    model = amp_compiler.convert(DataDependent(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16).abs()
    out = model(x)
    assert torch.allclose(out, DataDependent.forward(model, x), atol=0.05)
    assert any(reason.startswith("not captured") for reason in parts(model)[""].as_written.values())
    assert parts(model)["block"].graphs


def test_hooks_fire_once_per_call():
    model = Block()
    calls = []
    model.register_forward_hook(lambda m, i, o: calls.append("root"))
    model.up.register_forward_pre_hook(lambda m, i: calls.append(("up", i[0].dtype)))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    model(torch.randn(4, 16))
    model(torch.randn(4, 16))
    assert calls.count("root") == 2 and sum(1 for c in calls if c[0] == "up") == 2


class TrainingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        y = self.proj(x)
        return y * 0.5 if self.training else y


def test_train_and_eval_each_get_their_own_graph():
    model = amp_compiler.convert(TrainingBranch(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    train_out = model(x)
    model.eval()
    eval_out = model(x)
    assert torch.allclose(eval_out, 2 * train_out, atol=1e-6)
    model.train()
    assert torch.equal(model(x), train_out)
    assert parts(model)[""].captures == 2


def test_restore_gives_back_the_original_forwards():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(1.0))
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    assert not torch.equal(model(x, Opaque(1.0)), expected)
    assert amp_compiler.restore(model) is model
    assert torch.equal(model(x, Opaque(1.0)), expected)
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(TypeError, match="inplace=True"):
        amp_compiler.restore(model)


def test_converting_twice_and_dynamic_shapes_are_refused():
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True, capture="parts")
    with pytest.raises(ValueError, match="restore"):
        amp_compiler.convert(model, "O2", inplace=True, capture="parts")
    with pytest.raises(ValueError, match="dynamic_shapes"):
        amp_compiler.convert(Block(), "O1", inplace=True, capture="parts", dynamic_shapes={"x": {0: "batch"}})


def test_a_new_weight_loaded_with_assign_is_the_one_the_graph_reads():
    torch.manual_seed(0)
    model, other = Block(), Block()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    model(x)
    model.load_state_dict(other.state_dict(), assign=True)
    assert torch.allclose(model(x), other(x), rtol=0.02, atol=0.02)
    assert not torch.allclose(model(x), Block.forward(Block(), x), atol=0.02)


def test_deepcopy_and_torch_save_keep_a_working_conversion():
    torch.manual_seed(0)
    model = amp_compiler.convert(Block(), "O1", dtype=BF16, inplace=True, capture="parts")
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
    assert type(loaded) is Block and torch.equal(loaded(x), out)
    assert parts(loaded)[""].captures == 1   # saved without graphs: captured again on the first call


def test_example_inputs_capture_at_conversion_without_changing_buffers():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).train()
    statistics = model[1].running_mean.clone()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(torch.randn(16, 8) + 3,))
    assert parts(model)[""].captures == 1 and parts(model)[""].graphs
    assert torch.equal(model[1].running_mean, statistics) and model[1].num_batches_tracked == 0


def test_calibration_data_reaches_the_parts():
    torch.manual_seed(0)
    model = Block()
    samples = [(torch.randn(4, 16),), (torch.randn(4, 16) * 3,)]
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts", calibration_data=samples)
    model(torch.randn(4, 16))
    (graph,) = parts(model)[""].graphs[next(iter(parts(model)[""].graphs))]
    from amp_compiler.passes.node_facts import facts
    assert any("range" in facts(node) for node in graph.gm.graph.nodes)
    with pytest.raises(ValueError, match="sample 0"):
        amp_compiler.convert(Block(), "O1", inplace=True, capture="parts", calibration_data=[(torch.randn(4, 5),)])


def test_o0_changes_nothing():
    torch.manual_seed(0)
    model = TakesObject()
    x = torch.randn(4, 16)
    expected = model(x, Opaque(1.5))
    amp_compiler.convert(model, "O0", inplace=True, capture="parts")
    assert torch.equal(model(x, Opaque(1.5)), expected)


def test_a_submodule_switched_alone_to_eval_is_followed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    model(x)
    model[1].eval()   # the root is still in train mode: its call key is the same
    torch.manual_seed(1)
    assert torch.equal(model(x), model(x))   # no dropout any more
    assert torch.allclose(model(x), nn.Sequential.forward(model, x), rtol=0.02, atol=0.02)


def test_a_wrapper_put_on_the_forward_after_conversion_still_reaches_the_part():
    # Accelerate's prepare() rewraps model.forward.__func__ as a method of the model
    import types
    model = amp_compiler.convert(nn.Linear(16, 16), "O1", dtype=BF16, inplace=True, capture="parts")
    wrapped = model.forward.__func__
    model.forward = types.MethodType(lambda self, *args: wrapped(self, *args) + 0, model)
    x = torch.randn(4, 16)
    model(x)   # captures
    with AtenDtypeRecorder() as recorder:
        out = model(x)
    assert parts(model)[""].captures == 1 and recorder.input_dtypes("addmm") == {BF16}
    assert torch.allclose(out, nn.Linear.forward(model, x), rtol=0.02, atol=0.02)


class Middle(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.branchy = DataDependent()

    def forward(self, x):
        return self.branchy(self.proj(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.middle = Middle()

    def forward(self, x):
        return self.middle(x)


def test_an_untraceable_grandchild_is_converted_as_a_part_not_run_under_autocast():
    # (fx left the failed grandchild on its module stack: the capture failed with "Unexpected key".) An
    # untraceable module holding parameters makes its ancestors run as written, down to it: its traceable
    # siblings and its own children are graphs under the policy, not one opaque call under autocast.
    model = amp_compiler.convert(Outer(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(4, 16)
    out = model(x)
    reason = next(iter(parts(model)[""].as_written.values()))
    assert "middle.branchy cannot be traced" in reason and "inner" not in reason
    assert parts(model)["middle.proj"].graphs and parts(model)["middle.branchy.block"].graphs
    assert torch.allclose(out, Outer.forward(model, x), rtol=0.05, atol=0.05)
