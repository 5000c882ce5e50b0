"""torch.compile of a model converted in place (issue 20).

A part captures on its first call (fx tracing and compile_graph): under torch.compile that capture runs
eagerly (torch.compiler.disable), so dynamo breaks its graph on a call that captures and on no other.
  * warm (example_inputs= at conversion, or one eager call before compiling): torch._dynamo.explain finds no
    graph break and one graph, for an MLP, a transformer block of models/ and a tiny HF Llama (use_cache=False);
  * cold (the compiled model's first call captures): the results are right, each break names the capture
    (Part._capture_and_run) or the as-written bookkeeping (Part._record_as_written), and the next call has none;
  * the graph dynamo hands its backend runs the projections' matmuls in bf16 (its nodes' example values),
    forward and backward (aot_autograd's ATen graphs), and the compiled model's outputs and gradients are
    the uncompiled in-place model's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from functorch.compile import make_boxed_func

import amp_compiler
from amp_compiler.in_place import in_place_conversion
from models.transformer import TransformerBlock

BF16 = torch.bfloat16
MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class RecordingBackend:
    """A dynamo backend that keeps each FX graph it is handed and runs it as it is."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def matmul_input_dtypes(gm: torch.fx.GraphModule) -> list[tuple]:
    """(op name, dtypes of its tensor inputs) for each matmul-like node of a dynamo or ATen graph."""
    found = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if node.op == "call_function" and name in MATMULS:
            values = [_value(arg) for arg in node.all_input_nodes]
            found.append((name, tuple(v.dtype for v in values if isinstance(v, torch.Tensor))))
    return found


def _value(node):
    return node.meta.get("example_value", node.meta.get("val"))


def assert_matmuls_low(gm, expected: int):
    matmuls = matmul_input_dtypes(gm)
    assert len(matmuls) >= expected, f"{len(matmuls)} matmuls in the compiled graph, expected {expected}: {matmuls}"
    fp32 = [m for m in matmuls if set(m[1]) != {BF16}]
    assert not fp32, f"matmuls of the compiled graph reading fp32: {fp32}"


def breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def transformer_block():
    torch.manual_seed(0)
    return TransformerBlock(16, 2, 32, 0.0, norm_first=True, causal_max_length=8)


def explain_without_breaks(model, *args, **kwargs):
    explanation = torch._dynamo.explain(model)(*args, **kwargs)
    reasons = [reason.reason.splitlines()[0] for reason in explanation.break_reasons]
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, reasons


# -- warm: captured before torch.compile sees the model --------------------------------------------------

def test_example_inputs_at_conversion_compile_without_breaks_and_run_low():
    x = torch.randn(5, 8)
    model = amp_compiler.convert(mlp().eval(), "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(x,))
    expected = model(x)
    explain_without_breaks(model, x)
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    assert len(backend.graphs) == 1 and not breaks(), breaks()
    assert_matmuls_low(backend.graphs[0], expected=3)
    assert in_place_conversion(model).parts[""].captures == 1   # the compiled call captured nothing again


def test_one_eager_call_then_compile_a_transformer_block():
    x = torch.randn(2, 8, 16)
    model = amp_compiler.convert(transformer_block().eval(), "O1", dtype=BF16, inplace=True, capture="parts")
    expected = model(x)   # the eager call that captures
    explain_without_breaks(model, x)
    backend = RecordingBackend()
    out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(backend.graphs) == 1 and not breaks(), breaks()
    # query, key, value, out, expand, contract: bf16; attention's two matmuls too at O1
    assert_matmuls_low(backend.graphs[0], expected=6)
    fp32_model = transformer_block().eval()
    torch.testing.assert_close(out, fp32_model(x), rtol=0.05, atol=0.05)   # mixed, close to fp32


def test_compiled_training_step_gradients_are_the_in_place_models_and_run_low():
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    eager = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(x,))
    model = amp_compiler.convert(mlp(), "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(x,))
    aten_graphs = []

    def keep(gm, example_inputs):
        aten_graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    nn.functional.cross_entropy(eager(x).float(), y).backward()
    nn.functional.cross_entropy(compiled(x).float(), y).backward()
    assert not breaks(), breaks()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    forward, backward = aten_graphs
    assert_matmuls_low(forward, expected=3)
    assert_matmuls_low(backward, expected=5)   # input and weight gradients (the first layer's input has none)


@pytest.mark.real_models
@pytest.mark.slow
def test_tiny_llama_without_cache_compiles_without_breaks():
    import amp_compiler.models.torchvision_ops  # noqa: F401  (before transformers imports torchvision)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = amp_compiler.convert(LlamaForCausalLM(config).eval(), "O1", dtype=BF16, inplace=True, capture="parts")
    ids = torch.randint(0, 128, (2, 7))
    expected = model(ids, use_cache=False).logits
    explain_without_breaks(model, ids, use_cache=False)
    backend = RecordingBackend()
    logits = torch.compile(model, backend=backend)(ids, use_cache=False).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert len(backend.graphs) == 1 and not breaks(), breaks()
    # per layer q, k, v, o and gate, up, down; and the LM head
    assert_matmuls_low(backend.graphs[0], expected=7 * 2 + 1)


# -- cold: the compiled model's first call captures ------------------------------------------------------

def test_cold_compile_breaks_only_on_the_capturing_call_and_says_why():
    x = torch.randn(5, 8)
    reference = amp_compiler.convert(mlp().eval(), "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(x,))
    model = amp_compiler.convert(mlp().eval(), "O1", dtype=BF16, inplace=True, capture="parts")
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    first = breaks()
    assert first and all("Part._capture_and_run" in reason for reason in first), first
    assert in_place_conversion(model).parts[""].captures == 1
    counters.clear()
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    assert not breaks(), breaks()
    assert_matmuls_low(backend.graphs[-1], expected=3)


class Options:
    """An argument no graph can take: the root runs as written, its Linear children become parts."""
    scale = 2.0


class TakesOptions(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x, options):
        return self.down(torch.relu(self.up(x))) * options.scale


def test_cold_compile_of_a_model_run_as_written_converts_its_children_then_has_no_breaks():
    torch.manual_seed(0)
    model = amp_compiler.convert(TakesOptions().eval(), "O1", dtype=BF16, inplace=True, capture="parts")
    x = torch.randn(5, 8)
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    out = compiled(x, Options())
    first = breaks()
    assert first and all("Part._capture_and_run" in reason or "Part._record_as_written" in reason
                         for reason in first), first
    parts = in_place_conversion(model).parts
    assert set(parts) == {"", "up", "down"} and parts[""].as_written and parts["up"].graphs
    torch.testing.assert_close(out, model(x, Options()), rtol=0, atol=0)   # eager, the same graphs
    counters.clear()
    torch.testing.assert_close(compiled(x, Options()), out, rtol=0, atol=0)
    assert not breaks(), breaks()
    assert_matmuls_low(backend.graphs[-1], expected=2)


@pytest.mark.slow
def test_inductor_compiled_model_matches_the_eager_in_place_model():
    x = torch.randn(16, 8)
    fp32 = mlp().eval()(x)
    model = amp_compiler.convert(mlp().eval(), "O1", dtype=BF16, inplace=True, capture="parts", example_inputs=(x,))
    expected = model(x)
    out = torch.compile(model)(x)   # the default backend: inductor's CPU kernels
    assert not breaks(), breaks()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4)   # measured: identical
    assert not torch.equal(out, fp32)   # bf16 rounding shows: it ran low, as the eager in-place model does
