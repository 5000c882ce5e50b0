"""Frozen fp8 weights (issue 23): convert(model, "fp8", freeze=True) keeps each fp8 weight once as float8_e4m3fn with
its scale (amp_compiler/frozen.py, passes/fx/freeze_weight_casts.py), bit for bit what the unfrozen graph computes."""
import copy
import operator

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.frozen import HOLDER
from amp_compiler.passes.fx.fp8_runtime import E4M3, fp8_cast
from amp_compiler.passes.fx.freeze_weight_casts import amp_frozen_fp8_weight
from amp_compiler.passes.fx.runtime import amp_frozen_cast
from models import build
from test_freeze import _mutations

SCALINGS = ("current", "rowwise", "delayed")


class LinearsAndMatmul(nn.Module):
    """Two linears and a matmul against a (K, N) parameter: both weight layouts."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.proj = nn.Parameter(torch.randn(32, 48))

    def forward(self, x):
        return torch.relu(self.fc2(torch.relu(self.fc1(x)))) @ self.proj


def _fp8(model, inputs, freeze: bool, **options):
    return amp_compiler.convert(model, "fp8", example_inputs=inputs, fp8_min_dim=16, freeze=freeze, **options).eval()


def _pair(model, inputs, **options):
    """(frozen, unfrozen) fp8 conversions of `model`, in eval mode."""
    return _fp8(model, inputs, True, **options), _fp8(model, inputs, False, **options)


def _weight(gm, node):
    return operator.attrgetter(node.args[0].target)(gm)


def _expected_bytes(gm, scaling: str) -> int:
    """fp8 weights: one byte each, plus their scales (fp32: one per tensor, or one per weight row); other frozen
    casts (biases): their dtype's bytes."""
    total = 0
    for node in gm.graph.nodes:
        if node.target is amp_frozen_fp8_weight:
            weight, dim = _weight(gm, node), node.args[3]
            rows = weight.shape[0 if dim == -1 else 1] if scaling == "rowwise" else 1
            total += weight.numel() * torch.tensor([], dtype=E4M3).element_size() + 4 * rows
        elif node.target is amp_frozen_cast:
            total += _weight(gm, node).numel() * node.args[1].itemsize
    return total


def _holder(gm):
    return getattr(gm, HOLDER)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_frozen_fp8_weights_give_the_unfrozen_output_bit_for_bit_and_are_quantized_once(scaling):
    torch.manual_seed(0)
    model, x = LinearsAndMatmul().eval(), torch.randn(4, 8, 32)
    frozen, plain = _pair(model, (x,), fp8_scaling=scaling)
    assert frozen.meta["amp"]["frozen"]["fp8_weights_frozen"] == 3
    assert not any(n.target is fp8_cast and n.args[0].target is amp_frozen_cast for n in frozen.graph.nodes)
    fp8_weights = {n.args[0].target for n in frozen.graph.nodes if n.target is amp_frozen_fp8_weight}
    assert fp8_weights == {"fc1.weight", "fc2.weight", "proj"}
    bf16_copies = {n.args[0].target for n in frozen.graph.nodes if n.target is amp_frozen_cast}
    assert bf16_copies == {"fc1.bias", "fc2.bias"}   # no bf16 copy of an fp8 weight is kept
    with torch.no_grad():
        expected = plain(x)
        assert torch.equal(frozen(x), expected)
        made = _holder(frozen).copies_made
        for _ in range(2):
            assert torch.equal(frozen(x), expected)
    assert made == 5 and _holder(frozen).copies_made == made   # 3 fp8 weights, 2 biases: made on the first call
    assert amp_compiler.frozen_bytes(frozen) == _expected_bytes(frozen, scaling)
    bf16 = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), freeze=True).eval()
    with torch.no_grad():
        bf16(x)
    weights = sum(p.numel() for p in (model.fc1.weight, model.fc2.weight, model.proj))
    assert amp_compiler.frozen_bytes(bf16) - amp_compiler.frozen_bytes(frozen) >= weights - 4 * 200   # ~1 byte saved each


def test_zoo_gpt_frozen_at_fp8_is_the_unfrozen_output():
    task = build("gpt", size="small")
    frozen, plain = _pair(task.model.eval(), task.example_inputs)
    assert frozen.meta["amp"]["frozen"]["fp8_weights_frozen"] == plain.meta["amp"]["pass_counts"]["lower_fp8_matmuls"]["fp8"] > 0
    with torch.no_grad():
        assert torch.equal(frozen(*task.example_inputs), plain(*task.example_inputs))
    assert amp_compiler.frozen_bytes(frozen) == _expected_bytes(frozen, "current")


def test_delayed_scaling_quantizes_again_when_the_history_changes():
    torch.manual_seed(0)
    model, x = LinearsAndMatmul().eval(), torch.randn(4, 8, 32)
    frozen, plain = _pair(model, (x,), fp8_scaling="delayed", fp8_history=4)
    with torch.no_grad():
        before = frozen(x)
        made = _holder(frozen).copies_made
        frozen.fp8_history.linear.w[1] = 4096 * model.fc1.weight.abs().max()   # eval records nothing: was empty
        after = frozen(x)
        assert _holder(frozen).copies_made == made + 1 and not torch.equal(after, before)
        frozen.load_state_dict({"fp8_history.matmul.w": torch.full((4,), 300.0)}, strict=False)
        after = frozen(x)
        assert _holder(frozen).copies_made == made + 2
        plain.load_state_dict(frozen.state_dict())   # the same histories: the same scales
        assert torch.equal(after, plain(x))
    frozen.train()   # histories record: the weight is quantized per call, as unfrozen
    frozen(x).float().sum().backward()
    assert _holder(frozen).copies_made == made + 2


@pytest.mark.parametrize("mutation", [m.__name__ for m in _mutations(nn.Linear(1, 1))])
def test_a_changed_weight_is_quantized_again(mutation):
    torch.manual_seed(0)
    model, x = LinearsAndMatmul().eval(), torch.randn(4, 8, 32)
    frozen = _fp8(model, (x,), True)   # alone: an unfrozen graph would keep the replaced weights alive
    with torch.no_grad():
        before = frozen(x)
    next(m for m in _mutations(model) if m.__name__ == mutation)(model)
    if mutation == "new_parameter":   # the graph's module tree is a shallow copy of the model's
        frozen.fc1.weight = model.fc1.weight
    if mutation == "load_state_dict_assign":
        frozen.load_state_dict(model.state_dict(), assign=True)
    fresh = _fp8(copy.deepcopy(model), (x,), False)
    with torch.no_grad():
        after, expected = frozen(x), fresh(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)
    assert amp_compiler.frozen_bytes(frozen) == _expected_bytes(frozen, "current")   # no copy of a weight that is gone


def test_training_mode_quantizes_every_call_with_the_unfrozen_gradients():
    torch.manual_seed(0)
    model, x = LinearsAndMatmul(), torch.randn(4, 8, 32)
    frozen, plain = _pair(model, (x,))
    grads = []
    for gm in (frozen.train(), plain.train()):
        model.zero_grad(set_to_none=True)
        gm(x).float().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert amp_compiler.frozen_bytes(frozen) == 0


def test_a_frozen_fp8_graph_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model, x = LinearsAndMatmul().eval(), torch.randn(4, 8, 32)
    frozen, plain = _pair(model, (x,), fp8_scaling="rowwise")
    with torch.no_grad():
        expected = frozen(x)
    torch.save(frozen, tmp_path / "frozen.pt")
    loaded = torch.load(tmp_path / "frozen.pt", weights_only=False).eval()
    assert amp_compiler.frozen_bytes(loaded) == 0   # the copies are not saved: made again on the first call
    with torch.no_grad():
        assert torch.equal(loaded(x), expected) and torch.equal(loaded(x), plain(x))
    assert amp_compiler.frozen_bytes(loaded) == _expected_bytes(loaded, "rowwise")
