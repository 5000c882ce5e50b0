"""The weight-cast cache of amp_compiler.compile (backend="eager"): a weight's low copy made once and reused while
the weight is unchanged, by default in inference; cast afresh whenever autograd needs the weight."""
import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.frozen import FrozenWeights, packed_frozen_linear


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def cache_of(model) -> FrozenWeights:
    holders = {id(m): m for gm in graphs(model) for m in gm.modules() if isinstance(m, FrozenWeights)}
    assert len(holders) == 1, "every graph of one model reads one cache"
    return next(iter(holders.values()))


def weight_casts(monkeypatch, model) -> list:
    """The shapes of every cast to bf16 of the model's weight matrices made from now on."""
    made, weights = [], {p.data_ptr() for p in model.parameters() if p.dim() == 2}
    original = torch.Tensor.to

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.dtype is torch.bfloat16 and self.data_ptr() in weights and out.data_ptr() != self.data_ptr():
            made.append(tuple(self.shape))
        return out
    monkeypatch.setattr(torch.Tensor, "to", recording)
    return made


def test_inference_calls_cast_each_weight_once_and_match_the_uncached_graph(monkeypatch):
    model, x = mlp().eval(), torch.randn(4, 32)
    uncached = amp_compiler.compile(mlp().eval(), "O1", dtype=torch.bfloat16, backend="eager", weight_cache=False)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    with torch.no_grad():
        expected = uncached(x)
        casts = weight_casts(monkeypatch, model)
        outs = [model(x) for _ in range(4)]
    assert sorted(casts) == [(8, 64), (64, 32)], casts   # one cast per weight for four calls
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert amp_compiler.frozen_bytes(model) == (64 * 32 + 8 * 64) * 2 + (64 + 8) * 2   # bf16 weights + biases


def test_a_decode_and_its_prefill_share_one_copy_per_weight():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    model.generate(torch.randint(0, 64, (1, 5)), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert len(graphs(model)) >= 2   # prefill and decode
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    cache = cache_of(model)
    assert cache.copies_made == len(linears), (cache.copies_made, len(linears))
    packed = [n for gm in graphs(model) for n in gm.graph.nodes if n.target is packed_frozen_linear]
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert len(packed) == len(linears) * len(graphs(model))


@pytest.mark.parametrize("change", ["optimizer step", "write through .data", "new parameter"])
def test_a_changed_weight_is_cast_again(change):
    model, x = mlp().eval(), torch.randn(4, 32)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    with torch.no_grad():
        model(x)
        if change == "optimizer step":
            model[0].weight.add_(1.0)
        elif change == "write through .data":
            model[0].weight.data.mul_(3.0)
        else:
            model[0].weight = nn.Parameter(model[0].weight * -1)
        out = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            expected = mlp_like(model)(x)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def mlp_like(model):
    """An unconverted copy of the model's current weights (run under autocast as the reference)."""
    copy = mlp().eval()
    copy.load_state_dict(model.state_dict())
    return copy


def test_training_calls_cast_every_call_reach_the_weights_and_drop_the_copies():
    model, x = mlp(), torch.randn(4, 32)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad():
        model(x)
    assert amp_compiler.frozen_bytes(model) > 0
    before = model(x).float().sum().item()
    assert amp_compiler.frozen_bytes(model) == 0   # a grad-recording call: the copies would be stale after the step
    for _ in range(2):   # gradient accumulation: each micro-batch's backward reaches the weights
        model(x).float().pow(2).mean().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        after = model(x).float().sum().item()
        with torch.autocast("cpu", torch.bfloat16):
            expected = mlp_like(model)(x).float().sum().item()
    assert after != before
    assert abs(after - expected) <= 1e-2 * max(1.0, abs(expected))


def test_a_frozen_base_that_needs_no_gradient_stays_cached_while_grad_is_on():
    model, x = mlp().eval(), torch.randn(4, 32)
    model.requires_grad_(False)   # a LoRA base model: its weights take no gradient
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    model(x)
    model(x)
    assert cache_of(model).copies_made == 4   # two weights, two biases, once


def test_a_trainable_adapter_leaves_the_frozen_bases_copies_cached():
    """LoRA-like: the base weight needs no gradient, the head trains; reading the head (grad on) must not drop the
    base's copy (it did: every training step cast the base again)."""
    model, x = mlp().train(), torch.randn(4, 32)
    model[0].requires_grad_(False)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    for _ in range(3):
        model(x).float().sum().backward()
    cache = cache_of(model)
    assert cache.copies_made == 2, cache.copies_made   # model[0]'s weight and bias, once
    assert model[2].weight.grad is not None and model[0].weight.grad is None
