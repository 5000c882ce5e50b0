"""The fast call path of a model converted in place with frozen weights (benchmarks/bench_decode.py).

On TorchDynamo's capture the weight cache (amp_compiler/dynamo/weight_cache.py) keeps each weight's low copy,
oneDNN-packed for a bf16 CPU linear, and checks the copies at the start of each graph call. These tests check that
no cheaper path reads a stale copy: after an optimizer step, load_state_dict (also assign=True), an in-place write
under no_grad, a write through `.data`, `.data` assigned or a new Parameter, the frozen model gives what a model
converted afresh from the changed weights gives. amp_compiler.frozen.pack_linears(model): nothing to do there (the
cache packs already), refused with weight_cache=False; on a convert() result it packs the frozen copies.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.frozen import pack_linears, packed_frozen_linear
from amp_testing import ProfiledDtypes   # aten::equal events: the frozen copies' value checks

BF16 = torch.bfloat16


class State:
    """An object argument the blocks write to (like a KV cache): dynamo replays the write after its graph."""

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


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def frozen_net(seed: int = 0, packed: bool = False):
    """packed: pack_linears(model), a no-op on dynamo's capture (its weight cache packs bf16 CPU linears already)."""
    torch.manual_seed(seed)
    model = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True, freeze=True)
    return (pack_linears(model) if packed else model), torch.randn(3, 16)


def fresh_output(model, x):
    """What the model's current weights give converted afresh (its copies made from them on this call)."""
    fresh = amp_compiler.convert(copy.deepcopy(amp_compiler.restore(copy.deepcopy(model))), "O1", dtype=BF16,
                                 inplace=True)
    with torch.inference_mode():
        return fresh(x, State())


def value_checks(recorder: ProfiledDtypes) -> int:
    return sum(1 for name, _ in recorder.events if name == "aten::equal")


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


def test_a_call_that_raises_leaves_the_next_call_checked():
    model, x = frozen_net()
    with torch.inference_mode():
        model(x, State())
        with pytest.raises(RuntimeError):
            model(torch.randn(3, 5), State())   # wrong width: the call raises
    model.head.weight.data.mul_(-1.0)
    expected = fresh_output(model, x)
    with torch.inference_mode():
        assert torch.equal(model(x, State()), expected)


def test_a_frozen_model_without_value_samples_makes_no_comparison_and_sees_an_optimizer_step():
    """freeze(model, sample_values=False): no comparison at all (identity, version, storage only)."""
    torch.manual_seed(0)
    model, x = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True), torch.randn(3, 16)
    sampled, _ = frozen_net()
    with torch.inference_mode():
        sampled(x, State())
        with ProfiledDtypes() as recorder:
            sampled(x, State())
    assert value_checks(recorder) == 1   # sampled values: compared once per call (one graph)
    amp_compiler.freeze(model, sample_values=False)
    with torch.inference_mode():
        model(x, State())
        with ProfiledDtypes() as recorder:
            model(x, State())
    assert value_checks(recorder) == 0
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
def test_the_weight_cache_packs_the_linears_in_one_copy_and_pack_linears_changes_nothing():
    frozen, x = frozen_net()
    packed, _ = frozen_net(packed=True)
    with torch.inference_mode():
        expected = frozen(x, State())
        assert torch.equal(packed(x, State()), expected)
        assert torch.equal(packed(x, State()), expected)   # the packed copies in use
    for model in (frozen, packed):
        gms = graphs(model)
        assert gms and all(any(n.target is packed_frozen_linear for n in gm.graph.nodes) for gm in gms)
        assert sum(gm.meta["amp"]["frozen"]["linears_packed"] for gm in gms) == 5   # 2 blocks' up and down, head
    biases = sum(m.bias.numel() * 2 for m in packed.modules() if isinstance(m, nn.Linear))
    # the packed copy is the only copy (the parts' pack_linears kept a second one: 2x the weights' bytes)
    assert amp_compiler.frozen_bytes(frozen) == linear_weight_bytes(frozen) + biases
    assert amp_compiler.frozen_bytes(packed) == linear_weight_bytes(packed) + biases


def test_packed_linears_compute_as_written_while_training_and_with_fp32_inputs():
    packed, x = frozen_net(packed=True)
    with torch.inference_mode():
        packed(x, State())
    packed.train()
    reference = amp_compiler.convert(copy.deepcopy(amp_compiler.restore(copy.deepcopy(packed))), "O1", dtype=BF16,
                                     inplace=True)
    out = packed(x, State())
    assert out.requires_grad and torch.equal(out, reference(x, State()))


def test_pack_linears_refuses_a_model_without_frozen_copies():
    model = amp_compiler.convert(Net().eval(), "O1", dtype=BF16, inplace=True, weight_cache=False)
    with pytest.raises(TypeError, match="weight_cache=False"):
        pack_linears(model)
    with pytest.raises(TypeError, match="freeze"):
        pack_linears(nn.Linear(2, 2))


@pytest.mark.skipif(not ONEDNN_BF16, reason="needs oneDNN with bf16 (packed linear weights)")
@pytest.mark.parametrize("with_example_inputs", [True, False])
def test_pack_linears_on_a_frozen_convert_result(with_example_inputs):
    """The fx graph packs through the weight cache's own mechanism: each linear's packed copy instead of its plain
    one (the same bytes), with or without recorded values (example_inputs) to read the weights' shapes from."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval(), torch.randn(4, 16)
    options = {"example_inputs": (x,)} if with_example_inputs else {}
    frozen = amp_compiler.convert(model, "O1", dtype=BF16, freeze=True, **options).eval()
    packed = pack_linears(amp_compiler.convert(model, "O1", dtype=BF16, freeze=True, **options).eval())
    with torch.inference_mode():
        assert torch.equal(packed(x), frozen(x)) and torch.equal(packed(x), frozen(x))
        assert amp_compiler.frozen_bytes(packed) == amp_compiler.frozen_bytes(frozen) > 0   # not a second copy
        model[0].weight.data.mul_(2.0)   # seen by the sampled values
        assert torch.equal(packed(x), frozen(x))
    assert packed.meta["amp"]["frozen"]["linears_packed"] == 2
    assert sum(n.target is packed_frozen_linear for n in packed.graph.nodes) == 2
