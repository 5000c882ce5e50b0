"""Frozen inference (amp_compiler/frozen.py): weights cast once, never a stale copy."""
import copy
import operator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_compiler
from amp_compiler.passes.fx.runtime import amp_frozen_cast
from models import build


class WeightCastCounter(TorchDispatchMode):
    """Counts dtype casts (aten._to_copy; aten.to under inference_mode), and those whose input is one of
    `weights` (same storage)."""

    def __init__(self, weights):
        super().__init__()
        self.pointers = {w.data_ptr() for w in weights}
        self.weight_casts = self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and out.dtype != args[0].dtype:
            self.casts += 1
            self.weight_casts += args[0].data_ptr() in self.pointers
        return out


def _task(name: str):
    task = build(name, size="small")
    task.model.eval()
    return task.model, task.example_inputs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "bert", "gpt"])
def test_an_inference_call_casts_no_weight_and_returns_the_same_values(name):
    model, inputs = _task(name)
    plain = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs).eval()
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs, freeze=True).eval()
    assert frozen.meta["amp"]["frozen"]["weight_casts_frozen"] > 0
    weights = [*model.parameters(), *model.buffers()]
    with torch.inference_mode():
        with WeightCastCounter(weights) as unfrozen:
            expected = plain(*inputs)
        assert unfrozen.weight_casts > 0
        frozen(*inputs)                                  # the first call makes the copies
        with WeightCastCounter(weights) as counter:
            out = frozen(*inputs)
    assert counter.weight_casts == 0 and counter.casts == unfrozen.casts - unfrozen.weight_casts
    assert torch.equal(out, expected)
    assert amp_compiler.frozen_bytes(frozen) == _cast_bytes(frozen) > 0
    assert frozen.state_dict().keys() == model.state_dict().keys()


def _cast_bytes(frozen) -> int:
    """Bytes of the low copies of the weights the graph reads now."""
    reads = [n for n in frozen.graph.nodes if n.target is amp_frozen_cast]
    return sum(n.args[1].itemsize * operator.attrgetter(n.args[0].target)(frozen).numel() for n in reads)


def _mutations(model: nn.Module):
    """Ways a weight changes after the copies were made: name -> function of the model."""
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))

    def optimizer_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()

    def load_state_dict(m):
        m.load_state_dict({k: v * 1.5 if v.is_floating_point() else v for k, v in m.state_dict().items()})

    def load_state_dict_assign(m):
        m.load_state_dict({k: v * 0.5 if v.is_floating_point() else v for k, v in m.state_dict().items()},
                          assign=True)

    def in_place_no_grad(m):
        with torch.no_grad():
            first.weight.mul_(-1.0)

    def through_data(m):                                     # .data has a version counter of its own
        first.weight.data.mul_(3.0)

    def data_assigned(m):
        first.weight.data = torch.randn_like(first.weight)

    def new_parameter(m):
        first.weight = nn.Parameter(first.weight.detach() * 2)

    return [optimizer_step, load_state_dict, load_state_dict_assign, in_place_no_grad, through_data,
            data_assigned, new_parameter]


@pytest.mark.slow
@pytest.mark.parametrize("mutation", [m.__name__ for m in _mutations(nn.Linear(1, 1))])
def test_a_changed_weight_is_never_read_from_a_stale_copy(mutation):
    model, inputs = _task("resnet")
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs, freeze=True).eval()
    with torch.no_grad():
        before = frozen(*inputs)
    next(m for m in _mutations(model) if m.__name__ == mutation)(model)
    # Module edits made on the model reach the converted graph through its shallow copy of the module tree.
    if mutation == "new_parameter":
        frozen.get_submodule(next(n for n, m in model.named_modules() if isinstance(m, nn.Conv2d))).weight = \
            next(m for m in model.modules() if isinstance(m, nn.Conv2d)).weight
    if mutation == "load_state_dict_assign":
        frozen.load_state_dict(model.state_dict(), assign=True)
    fresh = amp_compiler.convert(copy.deepcopy(model), "O1", dtype=torch.bfloat16, example_inputs=inputs).eval()
    with torch.no_grad():
        after, expected = frozen(*inputs), fresh(*inputs)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)
    assert amp_compiler.frozen_bytes(frozen) == _cast_bytes(frozen)        # no copy of a weight that is gone


@pytest.mark.slow
def test_training_mode_casts_every_call_and_trains():
    model, inputs = _task("resnet")
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs, freeze=True)
    plain = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    frozen.train(), plain.train()
    grads = []
    for gm in (frozen, plain):
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng():
            gm(*inputs).float().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert amp_compiler.frozen_bytes(frozen) == 0          # no copy made while training
    frozen.eval()
    with torch.enable_grad():                                 # eval, but autograd needs the weights: cast as before
        frozen(*inputs).float().sum().backward()
    assert amp_compiler.frozen_bytes(frozen) == 0


def test_freeze_takes_only_converted_models_and_survives_save(tmp_path):
    with pytest.raises(TypeError, match="holds no converted graph"):
        amp_compiler.freeze(nn.Linear(2, 2))
    model, inputs = _task("mlp")
    frozen = amp_compiler.freeze(amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs))
    assert amp_compiler.freeze(frozen) is frozen                    # freezing twice changes nothing
    frozen.eval()
    with torch.no_grad():
        expected = frozen(*inputs)
    torch.save(frozen, tmp_path / "frozen.pt")
    loaded = torch.load(tmp_path / "frozen.pt", weights_only=False).eval()
    assert amp_compiler.frozen_bytes(loaded) == 0                    # the copies are not saved
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), expected)


@pytest.mark.slow
def test_explain_verify_and_compare_read_a_frozen_graph():
    model, inputs = _task("bert")
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs, freeze=True).eval()
    amp_compiler.verify(frozen, *inputs)                    # the recorded dtypes are the ones it runs
    assert "bfloat16" in str(amp_compiler.explain(frozen)).splitlines()[1]
    assert "passed" in str(amp_compiler.compare(model, frozen, inputs)).splitlines()[0]


class ComparisonCounter(TorchDispatchMode):
    """Counts aten.equal calls: each one is a device sync on a GPU (its answer is a Python bool)."""

    def __init__(self):
        super().__init__()
        self.comparisons = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.comparisons += func.overloadpacket is torch.ops.aten.equal
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_a_frozen_call_compares_all_weights_in_one_operation_and_still_sees_a_write_through_data():
    model, inputs = _task("gpt")
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs, freeze=True).eval()
    assert frozen.meta["amp"]["frozen"]["weight_casts_frozen"] > 10
    with torch.inference_mode():
        frozen(*inputs)                                   # makes the copies
        with ComparisonCounter() as counter:
            frozen(*inputs)
        assert counter.comparisons == 1                   # one per device per call, not one per weight
        weight = next(m for m in model.modules() if isinstance(m, nn.Linear)).weight
        weight.data.mul_(3)                               # .data: its own version counter, only values tell
        expected = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs).eval()(*inputs)
        assert torch.equal(frozen(*inputs), expected)


class GRUHead(nn.Module):
    """A low leaf fx cannot lower (nn.GRU): its parameters go through amp_module_call."""

    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


@pytest.mark.slow
def test_a_frozen_low_leaf_reads_cached_parameters_and_compare_still_replays_fp32():
    torch.manual_seed(0)
    model, x = GRUHead().eval(), torch.randn(2, 5, 8)
    plain = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,)).eval()
    frozen = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), freeze=True).eval()
    assert frozen.meta["amp"]["frozen"]["module_calls_frozen"] == 1
    with torch.inference_mode():
        frozen(x)
        with WeightCastCounter(model.gru.parameters()) as counter:
            out = frozen(x)
        with WeightCastCounter(model.gru.parameters()) as unfrozen:
            expected = plain(x)
    assert unfrozen.weight_casts == len(list(model.gru.parameters())) and counter.weight_casts == 0
    assert torch.equal(out, expected)
    errors = lambda gm: [(e.node, e.max_abs) for e in amp_compiler.compare(model, gm, (x,)).errors]   # noqa: E731
    assert errors(frozen) == errors(plain)             # the fp32 replay reads fp32 weights, frozen or not


@pytest.mark.slow
def test_freeze_without_value_samples_makes_no_comparison_and_still_sees_an_optimizer_step():
    model, inputs = _task("gpt")
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs).eval()
    amp_compiler.freeze(gm, sample_values=False)
    with torch.inference_mode():
        gm(*inputs)
        with ComparisonCounter() as counter:
            gm(*inputs)
    assert counter.comparisons == 0                       # no device sync per call
    next(m for m in _mutations(model) if m.__name__ == "optimizer_step")(model)   # seen without sampling
    with torch.inference_mode():
        expected = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs).eval()(*inputs)
        assert torch.equal(gm(*inputs), expected)
    with pytest.raises(TypeError, match="sample_values"):
        amp_compiler.freeze(amp_compiler.convert(model, "O1", example_inputs=inputs), sample_values="no")
