"""O1 runs batch and group norms as mixed kernels (low activations in, fp32 weights and statistics) because
they are as close to fp32 as the cast-pair version (the norm in fp32 between two casts): measured here on
outputs, gradients and, for batch norm in training mode over several steps, running statistics. A post-norm
LayerNorm is not (its output is the residual stream): O1 keeps layer norms fp32, as measured here too."""
import copy
import dataclasses

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.passes.policy.levels import LEVELS
from amp_testing import AtenDtypeRecorder, cast_nodes, precision_by_op

NORM_KERNELS = {"batch_norm": ("native_batch_norm", "_native_batch_norm_legit"),
                "group_norm": ("native_group_norm",), "layer_norm": ("native_layer_norm",)}


class ConvNormNet(nn.Module):
    """conv -> norm -> relu -> conv -> norm -> residual -> relu -> mean pool -> linear."""

    def __init__(self, norm: str):
        super().__init__()
        make = {"batch_norm": lambda: nn.BatchNorm2d(8), "group_norm": lambda: nn.GroupNorm(2, 8)}[norm]
        self.conv1, self.norm1 = nn.Conv2d(3, 8, 3, padding=1), make()
        self.conv2, self.norm2 = nn.Conv2d(8, 8, 3, padding=1), make()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        h = torch.relu(h + self.norm2(self.conv2(h)))
        return self.head(h.mean((2, 3)))   # a smooth pool: amax routes gradients by ties


def _model(norm: str) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    # Statistics far from (0, 1), as after a real layer: the running mean/var have work to do.
    return ConvNormNet(norm), lambda step: 3 + 2 * torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(floor)).item()


def _gradient_error(grads: dict, grads32: dict) -> float:
    """Worst relative error over the parameters whose gradient is not zero in exact arithmetic: a conv
    bias right before a batch/group norm gets none (the norm subtracts the mean), so fp32 returns ~1e-7
    there and either low-precision version its own rounding noise, which says nothing about accuracy."""
    largest = max(g.norm().item() for g in grads32.values())
    return max(_relative(grads[n], g) for n, g in grads32.items() if g.norm().item() > 1e-4 * largest)


def _errors(norm: str, dtype: torch.dtype, steps: int = 4) -> dict[str, dict[str, float]]:
    """Per version ("mixed", "cast_pair"): worst relative error against fp32 of the outputs and of the
    parameter gradients over `steps` training-mode steps, and of the running statistics after them."""
    model, batch = _model(norm)
    versions = {"fp32": copy.deepcopy(model)}
    versions["mixed"] = amp_compiler.convert(copy.deepcopy(model), "O1", dtype=dtype)
    versions["cast_pair"] = amp_compiler.convert(copy.deepcopy(model), "O1", dtype=dtype, keep_batchnorm_fp32=False)
    errors = {name: {"output": 0.0, "grad": 0.0, "stats": 0.0} for name in ("mixed", "cast_pair")}
    for step in range(steps):
        x = batch(step)
        results = {}
        for name, version in versions.items():
            version.train()
            version.zero_grad(set_to_none=True)
            out = version(x)
            out.float().square().mean().backward()
            results[name] = (out.detach(), {n: p.grad for n, p in version.named_parameters()})
        out32, grads32 = results["fp32"]
        for name in errors:
            out, grads = results[name]
            errors[name]["output"] = max(errors[name]["output"], _relative(out, out32))
            errors[name]["grad"] = max(errors[name]["grad"], _gradient_error(grads, grads32))
    buffers32 = dict(versions["fp32"].named_buffers())
    for name in errors:
        stats = [_relative(b, buffers32[n]) for n, b in versions[name].named_buffers() if b.is_floating_point()]
        errors[name]["stats"] = max(stats, default=0.0)
    return errors


def _within(errors: dict, dtype: torch.dtype) -> dict[str, bool]:
    """Per measure: is the mixed kernel within 1.5x of the cast pair's error, plus half a unit roundoff?"""
    epsilon = torch.finfo(dtype).eps / 4    # one more rounding of a value, at most
    return {what: errors["mixed"][what] <= 1.5 * errors["cast_pair"][what] + epsilon
            for what in ("output", "grad", "stats")}


O1_MIXED = LEVELS["O1"].mixed_norms


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("norm", O1_MIXED)
def test_o1_mixed_norm_kernels_are_as_close_to_fp32_as_a_cast_pair(norm, dtype):
    errors = _errors(norm, dtype)
    assert all(_within(errors, dtype).values()), errors
    if norm == "batch_norm":   # the running statistics were measured, not skipped
        assert 0 < errors["cast_pair"]["stats"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_layer_norm_as_a_mixed_kernel_misses_the_bar_on_bert_so_o1_keeps_it_fp32(dtype, monkeypatch):
    # The measurement behind O1's entry: BERT's LayerNorms are post-norm, their outputs the residual stream
    # and the model's output; mixed, they round that stream to the low dtype, the cast pair keeps it fp32.
    from real_models import REAL_MODELS
    assert "layer_norm" not in O1_MIXED
    spec = REAL_MODELS["hf_bert_eager"]
    model, inputs = spec.build(), spec.inputs()
    with torch.no_grad():
        reference = spec.output(model(*inputs))
    errors = {}
    for name, mixed_norms in (("cast_pair", O1_MIXED), ("mixed", (*O1_MIXED, "layer_norm"))):
        monkeypatch.setitem(LEVELS, "O1", dataclasses.replace(LEVELS["O1"], mixed_norms=mixed_norms))
        gm = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=inputs)
        with torch.no_grad():
            errors[name] = (spec.output(gm(*inputs)) - reference).abs().max().item() / reference.abs().max().item()
    assert errors["mixed"] > 1.5 * errors["cast_pair"] + torch.finfo(dtype).eps / 4, errors


@pytest.mark.parametrize("norm", O1_MIXED)
def test_o1_norms_read_low_activations_with_fp32_weights_and_no_cast_pair(norm):
    model, batch = _model(norm)
    mixed = amp_compiler.convert(model, "O1", dtype=torch.bfloat16)
    pair = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, keep_batchnorm_fp32=False)
    assert precision_by_op(mixed)[norm] == {"low"} and precision_by_op(pair)[norm] == {"fp32"}
    # The norm's own parameters are never cast; no cast reads or feeds a norm.
    norm_nodes = [n for n in mixed.graph.nodes if n.meta["amp"].get("op") == norm]
    assert all(n.meta["amp"]["fp32_weights"] for n in norm_nodes)
    touching = [c for c in cast_nodes(mixed) if c.args[0] in norm_nodes or any(u in norm_nodes for u in c.users)]
    assert not touching, [c.name for c in touching]
    assert len(cast_nodes(mixed)) < len(cast_nodes(pair))
    recorder = AtenDtypeRecorder()
    with recorder:
        mixed(batch(0))
    calls = [dtypes for op in NORM_KERNELS[norm] for dtypes in recorder.calls.get(op, [])]
    assert calls and all(d[0] == torch.bfloat16 and set(d[1:]) == {torch.float32} for d in calls)


def test_the_level_table_says_which_norms_are_mixed_and_user_rules_win():
    from amp_compiler.config import make_config
    for level in ("O2", "O3"):
        rules = make_config(level, keep_batchnorm_fp32=True).precision_rules()
        assert rules.classify("layer_norm")[0] == rules.classify("batch_norm")[0] == "allow"
        assert rules.keeps_fp32_weights("layer_norm") and not rules.keeps_fp32_weights("instance_norm")
    o1 = make_config("O1").precision_rules()
    # infer at O1: low when it sits between low ops (conv -> bn -> relu -> conv), fp32 on an fp32 input
    assert o1.classify("batch_norm")[0] == o1.classify("group_norm")[0] == "infer"
    assert o1.classify("layer_norm")[0] == o1.classify("instance_norm")[0] == o1.classify("rms_norm")[0] == "deny"
    assert o1.keeps_fp32_weights("batch_norm") and not o1.keeps_fp32_weights("layer_norm")
    assert make_config("O1", keep_batchnorm_fp32=False).precision_rules().classify("batch_norm")[0] == "deny"
    assert make_config("O1", deny_ops=["batch_norm"]).precision_rules().classify("batch_norm")[0] == "deny"
    assert make_config("O0").precision_rules().classify("batch_norm")[0] == "deny"


class NormalisedTable(nn.Module):
    """DeBERTa-v3's relative-position path: a LayerNorm of a parameter (the table), read by a Linear."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 8))
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x @ self.proj(self.norm(self.table)).t()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_mixed_norm_whose_data_input_is_a_parameter_reads_it_low(level):
    # The data input of a mixed norm kernel is cast like any activation; only its weights stay fp32.
    # It used to stay fp32 too, so the 'low' norm returned fp32 into a bf16 Linear: a dtype error at run time.
    torch.manual_seed(0)
    model, x = NormalisedTable().eval(), torch.randn(3, 8)
    gm = amp_compiler.convert(model, level, dtype=torch.bfloat16, example_inputs=(x,), keep_batchnorm_fp32=True)
    amp_compiler.verify(gm, x)
    assert torch.allclose(gm(x), model(x), atol=0.15, rtol=0.05)
