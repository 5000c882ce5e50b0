"""The fast call path of a model converted in place with frozen weights (benchmarks/bench_decode.py).

Its frozen part graphs compare their weights' sampled values once per model call, all graphs together
(InPlaceConversion.values_checked, amp_compiler.frozen.JoinedValueCheck), not once per graph call. These
tests check that no cheaper path reads a stale copy: after an optimizer step, load_state_dict (also
assign=True), an in-place write under no_grad, a write through `.data`, `.data` assigned or a new
Parameter, the frozen model gives what a model converted afresh from the changed weights gives.
amp_compiler.frozen.pack_linears(model): the same, its linears reading oneDNN-packed copies (CPU, bf16).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.frozen import frozen_linear, pack_linears
from amp_compiler.in_place import in_place_conversion
from test_freeze import ComparisonCounter   # aten.equal calls: the frozen copies' value checks

BF16 = torch.bfloat16


class State:
    """An argument no graph can take (like a KV cache): the parts that receive it run as written, so their
    Linear children are the graphs."""

    def __init__(self):
        self.calls = 0


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, state: State):
        state.calls += 1
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x, state: State):
        for block in self.blocks:
            x = block(x, state)
        return self.head(x)


def frozen_net(seed: int = 0, packed: bool = False):
    torch.manual_seed(seed)
    model = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True, capture="parts", freeze=True)
    return (pack_linears(model) if packed else model), torch.randn(3, 16)


def graph_count(model) -> int:
    return len(in_place_conversion(model).graph_modules())


def fresh_output(model, x):
    """What the model's current weights give converted afresh (no copies kept: cast on this call)."""
    fresh = amp_compiler.convert(copy.deepcopy(amp_compiler.restore(copy.deepcopy(model))), "O1", dtype=BF16,
                                 inplace=True, capture="parts")
    with torch.inference_mode():
        return fresh(x, State())


def mutations(model: Net):
    """name -> a change of model.blocks[1].up's weight (or of all weights) after the copies were made."""
    linear = model.blocks[1].up

    def optimizer_step():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()

    def load_state_dict():
        model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})

    def load_state_dict_assign():
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()}, assign=True)

    def in_place_no_grad():
        with torch.no_grad():
            linear.weight.mul_(-1.0)

    def through_data():   # .data has a version counter of its own: only the sampled values can tell
        linear.weight.data.mul_(3.0)

    def data_assigned():
        linear.weight.data = torch.randn_like(linear.weight)

    def new_parameter():
        linear.weight = nn.Parameter(linear.weight.detach() * 2)

    return {f.__name__: f for f in (optimizer_step, load_state_dict, load_state_dict_assign, in_place_no_grad,
                                    through_data, data_assigned, new_parameter)}


MUTATIONS = list(mutations(Net()))


@pytest.mark.parametrize("packed", [False, True], ids=["frozen", "packed"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_frozen_in_place_model_never_reads_a_stale_copy(mutation, packed):
    model, x = frozen_net(packed=packed)
    with torch.inference_mode():
        before = model(x, State())
        model(x, State())   # the copies are in use
    mutations(model)[mutation]()
    expected = fresh_output(model, x)
    assert not torch.equal(expected, before)   # the change shows in the output
    with torch.inference_mode():
        assert torch.equal(model(x, State()), expected)


def test_the_values_are_compared_once_per_model_call_for_all_graphs():
    model, x = frozen_net()
    with torch.inference_mode():
        model(x, State())
        with ComparisonCounter() as counter:
            model(x, State())
            model(x, State())
    assert graph_count(model) == 5   # up and down of two blocks, head: each a graph with its own copies
    assert counter.comparisons == 2  # one per model call (was one per graph call: 10)


def test_a_part_called_on_its_own_checks_the_values_too():
    model, x = frozen_net()
    block = model.blocks[0]
    with torch.inference_mode():
        model(x, State())
        block(x, State())
    block.up.weight.data.mul_(2.0)   # seen only by the values
    with torch.inference_mode():
        out = block(x, State())
    reference = amp_compiler.convert(copy.deepcopy(amp_compiler.restore(copy.deepcopy(model)).blocks[0]), "O1",
                                     dtype=BF16, inplace=True, capture="parts")
    with torch.inference_mode():
        assert torch.equal(out, reference(x, State()))


def test_a_call_that_raises_leaves_the_next_call_checked():
    model, x = frozen_net()
    with torch.inference_mode():
        model(x, State())
        with pytest.raises(RuntimeError):
            model(torch.randn(3, 5), State())   # wrong width: the as-written block raises inside the call
    assert not in_place_conversion(model).calling
    model.head.weight.data.mul_(-1.0)
    expected = fresh_output(model, x)
    with torch.inference_mode():
        assert torch.equal(model(x, State()), expected)


def test_frozen_parts_not_checked_together_check_themselves():
    """freeze(model, sample_values=False): no comparison at all (identity, version, storage only)."""
    torch.manual_seed(0)
    model, x = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True, capture="parts"), torch.randn(3, 16)
    amp_compiler.freeze(model, sample_values=False)
    with torch.inference_mode():
        model(x, State())
        with ComparisonCounter() as counter:
            model(x, State())
    assert counter.comparisons == 0
    mutations(model)["optimizer_step"]()   # seen by the version counters
    expected = fresh_output(model, x)
    with torch.inference_mode():
        assert torch.equal(model(x, State()), expected)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_frozen_in_place_model_checks_its_own_weights(how):
    model, x = frozen_net()
    with torch.inference_mode():
        model(x, State())
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    with torch.inference_mode():
        twin(x, State())
    twin.blocks[0].down.weight.data.mul_(0.5)
    expected = fresh_output(twin, x)
    with torch.inference_mode():
        assert torch.equal(twin(x, State()), expected)
        assert not torch.equal(model(x, State()), expected)   # the original's weights are its own


def linear_weight_bytes(model, dtype=BF16) -> int:
    return sum(m.weight.numel() * dtype.itemsize for m in model.modules() if isinstance(m, nn.Linear))


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not ONEDNN_BF16, reason="needs oneDNN with bf16 (packed linear weights)")
def test_packed_linears_give_the_frozen_outputs_bit_for_bit_and_cost_a_second_copy():
    frozen, x = frozen_net()
    packed, _ = frozen_net(packed=True)
    with torch.inference_mode():
        expected = frozen(x, State())
        assert torch.equal(packed(x, State()), expected)
        assert torch.equal(packed(x, State()), expected)   # the packed copies in use
    gms = in_place_conversion(packed).graph_modules()
    assert all(any(n.target is frozen_linear for n in gm.graph.nodes) for gm in gms)
    assert sum(gm.meta["amp"]["frozen"]["linears_packed"] for gm in gms) == 5
    biases = sum(m.bias.numel() * 2 for m in packed.modules() if isinstance(m, nn.Linear))
    assert amp_compiler.frozen_bytes(frozen) == linear_weight_bytes(frozen) + biases
    assert amp_compiler.frozen_bytes(packed) == 2 * linear_weight_bytes(packed) + biases


def test_packed_linears_compute_as_written_while_training_and_with_fp32_inputs():
    packed, x = frozen_net(packed=True)
    with torch.inference_mode():
        packed(x, State())
    packed.train()
    reference = amp_compiler.convert(copy.deepcopy(amp_compiler.restore(copy.deepcopy(packed))), "O1", dtype=BF16,
                                     inplace=True, capture="parts")
    out = packed(x, State())
    assert out.requires_grad and torch.equal(out, reference(x, State()))
    weight = packed.head.weight
    assert torch.equal(frozen_linear(x, weight, None), torch.nn.functional.linear(x, weight))   # an fp32 replay


def test_pack_linears_refuses_a_model_without_frozen_copies():
    model = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True, capture="parts")
    with pytest.raises(TypeError, match="freeze"):
        pack_linears(model)
    with pytest.raises(TypeError, match="freeze"):
        pack_linears(nn.Linear(2, 2))


@pytest.mark.skipif(not ONEDNN_BF16, reason="needs oneDNN with bf16 (packed linear weights)")
def test_pack_linears_on_a_frozen_convert_result():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval(), torch.randn(4, 16)
    frozen = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,), freeze=True).eval()
    packed = pack_linears(amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,), freeze=True).eval())
    with torch.inference_mode():
        assert torch.equal(packed(x), frozen(x)) and torch.equal(packed(x), frozen(x))
        model[0].weight.data.mul_(2.0)   # seen by the sampled values
        assert torch.equal(packed(x), frozen(x))
    assert packed.meta["amp"]["frozen"]["linears_packed"] == 2
