"""Training paths that crashed or did not fall back (issue 29): a model converted in eval and trained, the
train step of what convert() runs as written with converted children, batch norm over a transposed tensor in
the joint graph, and a training-mode branch that cannot be captured."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler import build_train_network

FP16 = torch.float16


class FiniteGuard(nn.Module):
    """`if self.training: if not torch.isfinite(h).all(): clamp`: capturable in eval, not in train."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.encode(x)
        if self.training:
            if not torch.isfinite(h).all():
                h = h.clamp(-100, 100)
        return self.head(F.dropout(h, 0.25, self.training))


@pytest.mark.parametrize("example_inputs", [False, True], ids=["lazy", "example_inputs"])
def test_a_training_branch_that_cannot_be_captured_runs_as_written_with_its_children_converted(example_inputs):
    torch.manual_seed(0)
    model, x = FiniteGuard().eval(), torch.randn(3, 8)
    gm = amp_compiler.convert(model, "O1", example_inputs=(x,) if example_inputs else None)
    assert gm.meta["amp"]["frontend"] == "fx.symbolic_trace"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm.train()                              # before: TracingError (lazy) or AttributeError 'graph'
        torch.manual_seed(1)
        out = gm(x)
        gm(x)
    said = [str(w.message) for w in caught if "cannot be captured in train mode" in str(w.message)]
    assert len(said) == 1 and "FiniteGuard" in said[0] and "encode, head" in said[0], said
    model.train()
    torch.manual_seed(1)
    expected = model(x)
    assert torch.allclose(out.float(), expected, atol=1e-2), (out - expected).abs().max()
    out.sum().backward()
    assert model.encode.weight.grad is not None
    report = amp_compiler.explain(gm)
    assert report.summary["frontend"] == "as written, children converted"
    assert report.totals["nodes_per_dtype"].get("float16") == 2          # both linears, in their children
    opening = " ".join(line.strip() for line in report.summary_lines())
    assert "train mode: the model cannot be captured" in opening and "runs as written" in opening, opening
    assert sorted(gm.state_dict()) == sorted(model.state_dict())          # nothing registered on gm
    gm.eval()
    assert gm.meta["amp"]["frontend"] == "fx.symbolic_trace"              # eval keeps its graph
    model.eval()
    assert torch.allclose(gm(x).float(), model(x), atol=1e-2)


def _tiny_wav2vec2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0)   # SpecAugment draws from numpy: not seeded here
    return transformers.Wav2Vec2ForCTC(config).eval()


@pytest.mark.slow   # four torch.export attempts (eval, then train: the model and its wav2vec2 child)
def test_wav2vec2_converted_in_eval_then_trained_runs_its_train_mode():
    """Its encoder's layerdrop (torch.rand < p) cannot be captured in train mode: before, the train-mode
    capture raised AttributeError: 'Wav2Vec2ForCTC' object has no attribute 'graph'."""
    model, x = _tiny_wav2vec2(), torch.randn(2, 400)
    gm = amp_compiler.convert(model, "O1", example_inputs=(x,))
    with pytest.warns(UserWarning, match="Wav2Vec2ForCTC cannot be captured in train mode"):
        gm.train()
    model.train()
    torch.manual_seed(1)
    ours = gm(x).logits
    torch.manual_seed(1)
    expected = model(x).logits
    assert torch.allclose(ours.float(), expected, atol=5e-3), (ours - expected).abs().max()
    ours.float().pow(2).mean().backward()
    assert model.lm_head.weight.grad is not None
    assert "lm_head" in amp_compiler.explain(gm).summary["children"]


class DataDependentTop(nn.Module):
    """Its top level reads a tensor's value in Python: convert() runs it as written, its children converted."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(16))   # read by the top level as written: must stay fp32

    def forward(self, x):
        h = self.encode(x)
        if h.sum() > 0:
            h = h * self.scale
        return self.head(h)


class MeanPoolGraph(nn.Module):
    """PyG's global_mean_pool without a size: the number of graphs is int(batch.max()) + 1."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, batch):
        h = self.encode(x).relu()
        size = int(batch.max()) + 1
        pooled = torch.zeros(size, h.shape[1], dtype=h.dtype).index_add_(0, batch, h)
        count = torch.zeros(size, dtype=h.dtype).index_add_(0, batch, torch.ones_like(batch, dtype=h.dtype))
        return self.head(pooled / count[:, None])


@pytest.mark.parametrize("build, inputs, label", [
    (DataDependentTop, lambda: (torch.randn(6, 8),), lambda: torch.randn(6, 4)),
    (MeanPoolGraph, lambda: (torch.randn(10, 8), torch.tensor([0] * 4 + [1] * 6)), lambda: torch.randn(2, 3)),
], ids=["data_dependent_top", "pyg_mean_pool"])
def test_o2_train_step_of_a_model_run_as_written_stores_its_childrens_weights_low_and_trains(build, inputs, label):
    torch.manual_seed(0)
    model, inputs, label = build().train(), inputs(), label()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = amp_compiler.DynamicLossScaleManager(init_loss_scale=2 ** 8)
    step = build_train_network(model, optimizer, nn.MSELoss(), level="O2", dtype=FP16, example_inputs=inputs,
                               loss_scale_manager=manager)   # before: AttributeError: ... has no attribute 'graph'
    assert step.converted.meta["amp"]["frontend"] == "as written, children converted"
    stored = {name for pair in step.low_weights.pairs for name in pair.names}
    assert {"encode.weight", "head.weight"} <= {n.replace(".0.", ".") for n in stored}, stored
    assert not any(name.startswith("scale") for name in stored)
    reference = model(*inputs)
    expected_grads = torch.autograd.grad(nn.MSELoss()(reference, label), [model.head.weight])[0]
    losses = []
    for _ in range(6):
        loss, overflow, _ = step(*inputs, label)
        assert not overflow and torch.isfinite(loss)
        losses.append(loss.item())
        if len(losses) == 1:   # the first step's master gradient is fp32 autograd's, to fp16's error
            assert torch.allclose(model.head.weight.grad, expected_grads, rtol=2e-2, atol=1e-3)
    assert losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "steps run eagerly" in step.report() and "reads tensor values" in step.report()
    converted = amp_compiler.convert(model, "O2", example_inputs=inputs)      # low_weights() takes it too
    weights = amp_compiler.low_weights(converted, torch.optim.SGD(model.parameters(), lr=0.1))
    assert {name for pair in weights.pairs for name in pair.names} == stored


class TokenBatchNorm(nn.Module):
    """A time-series transformer's token BatchNorm: transpose -> BatchNorm1d -> transpose back -> view."""

    def __init__(self, d: int = 64, length: int = 7) -> None:
        super().__init__()
        self.embed, self.norm = nn.Linear(3, d), nn.BatchNorm1d(d)
        self.mix, self.head = nn.Linear(d, d), nn.Linear(d * length, 2)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = self.mix(h)
        return self.head(h.view(h.shape[0], -1))


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_train_step_runs_batch_norm_over_a_transposed_tensor(level):
    """The fake batch norm keeps the input's strides (448, 1, 64), the CPU kernel returns (448, 7, 1): the
    view after it failed at run time ('view size is not compatible'), at every level."""
    torch.manual_seed(0)
    model, x, y = TokenBatchNorm().train(), torch.randn(4, 7, 3), torch.randn(4, 2)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = torch.autograd.grad(nn.MSELoss()(model(x), y), list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    step = build_train_network(model, optimizer, nn.MSELoss(), level=level, dtype=torch.bfloat16)
    loss, overflow, _ = step(x, y)
    assert not overflow and torch.isfinite(loss)
    tolerance = 1e-5 if level == "O0" else 5e-2
    for (name, param), grad in zip(model.named_parameters(), expected):
        assert torch.allclose(param.grad, grad, rtol=tolerance, atol=tolerance), name
        assert torch.equal(param.detach(), reference[name])   # lr 0
    assert "with_traced_strides" in step.graph_module.code
