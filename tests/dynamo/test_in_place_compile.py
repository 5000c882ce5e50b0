"""torch.compile of a model converted in place (issue 20), on TorchDynamo's capture.

The converted model's forward is a CompiledForward that an enclosing torch.compile does not trace (it is
torch.compiler.disable'd: traced, its graphs would be inlined into the user's compilation with the user's backend,
every matmul fp32): the user's compilation breaks its graph there, once, and the conversion's own graphs run inside.
  * warm (example_inputs= at conversion, or one eager call before compiling) and cold (the compiled model's first
    call makes the graphs): the compiled model's outputs are the eager in-place model's, for an MLP, a transformer
    block of models/, a model taking a Python object and a tiny HF Llama (use_cache=False);
  * the only graph break the user's compilation has is that hidden call, and a second compiled call makes no
    graph;
  * the matmuls run bf16 at run time (torch.profiler: a TorchDispatchMode would make dynamo fall back to
    autocast), forward and backward, and the compiled model's gradients are the uncompiled in-place model's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from functorch.compile import make_boxed_func

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record
from amp_compiler.passes.node_facts import facts
from amp_testing import ProfiledDtypes
from models.transformer import TransformerBlock

BF16 = torch.bfloat16
MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}
# the ATen matmuls a CPU run records (a cached bf16 linear is oneDNN's packed one), attention's fused kernel too
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "mkldnn::_linear_pointwise",
              "_scaled_dot_product_flash_attention_for_cpu")


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


def assert_no_matmul_handed_to(backend: RecordingBackend):
    """The user's backend got none of the model's matmuls to run as captured (fp32): they run in the
    conversion's graphs, inside the call it does not trace."""
    handed = [m for gm in backend.graphs for m in matmul_input_dtypes(gm)]
    assert not handed, f"matmuls the user's backend compiled itself: {handed}"


def assert_converted_low(model, expected: int):
    """The conversion's graphs hold `expected` matmuls or more, every one low, and none fell back to autocast."""
    state = compiled_record(model)
    assert not state.converter.fallbacks and state.not_captured is None, (state.converter.fallbacks,
                                                                          state.not_captured)
    precisions = [facts(n).get("precision") for gm in graphs(model) for n in gm.graph.nodes
                  if facts(n).get("family") in ("matmul", "attention")]
    assert len(precisions) >= expected and set(precisions) == {"low"}, precisions


def assert_ran_low(recorder: ProfiledDtypes):
    read = recorder.input_dtypes(*MATMUL_OPS)
    assert read == {BF16}, f"matmuls read {sorted(map(str, read))}: {recorder.calls}"


def breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


def assert_only_the_hidden_call_breaks():
    """The user's compilation breaks at the converted model's CompiledForward (torch.compiler.disable) only."""
    found = breaks()
    assert found and all("torch.compiler.disable" in reason and "_run" in reason for reason in found), found


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def transformer_block():
    torch.manual_seed(0)
    return TransformerBlock(16, 2, 32, 0.0, norm_first=True, causal_max_length=8)


def convert(model, **options):
    return amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, **options)


# -- warm: captured before torch.compile sees the model --------------------------------------------------

def test_example_inputs_at_conversion_then_torch_compile_runs_the_same_graphs_low():
    x = torch.randn(5, 8)
    model = convert(mlp().eval(), example_inputs=(x,))
    assert graphs(model), "no graph made at conversion"
    with torch.no_grad():   # the example inputs' call ran without grad (a guard of dynamo's): that graph
        expected = model(x)
        made = len(graphs(model))
        backend = RecordingBackend()
        compiled = torch.compile(model, backend=backend)
        torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
        assert len(graphs(model)) == made   # the compiled call captured nothing again
        assert_only_the_hidden_call_breaks()
        assert_no_matmul_handed_to(backend)
        with ProfiledDtypes() as recorder:
            compiled(x)
    assert_ran_low(recorder)
    assert_converted_low(model, expected=3)


def test_one_eager_call_then_compile_a_transformer_block():
    x = torch.randn(2, 8, 16)
    model = convert(transformer_block().eval())
    expected = model(x)   # the eager call that captures
    made = len(graphs(model))
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(graphs(model)) == made
    assert_only_the_hidden_call_breaks()
    assert_no_matmul_handed_to(backend)
    with ProfiledDtypes() as recorder:
        compiled(x)
    assert_ran_low(recorder)
    # query, key, value, out, expand, contract: bf16; attention's two matmuls too at O1
    assert_converted_low(model, expected=6)
    fp32_model = transformer_block().eval()
    torch.testing.assert_close(out, fp32_model(x), rtol=0.05, atol=0.05)   # mixed, close to fp32


def test_compiled_training_step_gradients_are_the_in_place_models_and_run_low():
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    eager = convert(mlp())
    model = convert(mlp())
    aten_graphs = []

    def keep(gm, example_inputs):
        aten_graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    nn.functional.cross_entropy(eager(x).float(), y).backward()
    nn.functional.cross_entropy(compiled(x).float(), y).backward()
    assert_only_the_hidden_call_breaks()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    # the user's aot_autograd traced none of the model's matmuls (they would have run as captured, fp32)
    assert not [m for gm in aten_graphs for m in matmul_input_dtypes(gm)], aten_graphs
    made = len(graphs(model))
    with ProfiledDtypes() as forward:
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
    with ProfiledDtypes() as backward:
        loss.backward()
    assert len(graphs(model)) == made
    assert_ran_low(forward)
    assert_ran_low(backward)   # input and weight gradients
    assert len(backward.calls.get("mm", [])) >= 5, backward.calls   # (the first layer's input has none)
    assert_converted_low(model, expected=3)


@pytest.mark.real_models
@pytest.mark.slow
def test_tiny_llama_without_cache_under_torch_compile_runs_low():
    import amp_compiler.models.torchvision_ops  # noqa: F401  (before transformers imports torchvision)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = convert(LlamaForCausalLM(config).eval())
    ids = torch.randint(0, 128, (2, 7))
    expected = model(ids, use_cache=False).logits
    made = len(graphs(model))
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    logits = compiled(ids, use_cache=False).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert len(graphs(model)) == made
    assert_only_the_hidden_call_breaks()
    assert_no_matmul_handed_to(backend)
    with ProfiledDtypes() as recorder:
        compiled(ids, use_cache=False)
    assert_ran_low(recorder)
    # per layer q, k, v, o and gate, up, down; and the LM head
    assert_converted_low(model, expected=7 * 2 + 1)


# -- cold: the compiled model's first call captures ------------------------------------------------------

def test_cold_compile_captures_on_the_first_compiled_call_and_runs_low():
    # the parts captured eagerly inside the user's compilation, a graph break each (Part._capture_and_run); on
    # dynamo the conversion's graphs are made inside the hidden call, the same as an eager call makes them
    x = torch.randn(5, 8)
    reference = convert(mlp().eval())
    reference(x)
    model = convert(mlp().eval())
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    assert len(graphs(model)) == 1
    assert_only_the_hidden_call_breaks()
    counters.clear()
    with ProfiledDtypes() as recorder:
        torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    assert len(graphs(model)) == 1 and not breaks(), breaks()   # the second call: no graph, no break
    assert_ran_low(recorder)
    assert_no_matmul_handed_to(backend)
    assert_converted_low(model, expected=3)


class Options:
    """An argument no fx graph can take (the parts ran the root as written, its Linear children as parts):
    dynamo reads its attribute and guards on it."""
    scale = 2.0


class TakesOptions(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x, options):
        return self.down(torch.relu(self.up(x))) * options.scale


def test_cold_compile_of_a_model_taking_a_python_object_converts_it_whole():
    torch.manual_seed(0)
    model = convert(TakesOptions().eval())
    x = torch.randn(5, 8)
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    out = compiled(x, Options())
    assert_only_the_hidden_call_breaks()
    assert len(graphs(model)) == 1
    modules = {facts(n).get("module") for gm in graphs(model) for n in gm.graph.nodes
               if facts(n).get("family") == "matmul"}
    assert modules == {"up", "down"}, modules   # one graph of the whole forward, both linears in it
    torch.testing.assert_close(out, model(x, Options()), rtol=0, atol=0)   # eager, the same graph
    counters.clear()
    with ProfiledDtypes() as recorder:
        torch.testing.assert_close(compiled(x, Options()), out, rtol=0, atol=0)
    assert len(graphs(model)) == 1 and not breaks(), breaks()
    assert_ran_low(recorder)
    assert_converted_low(model, expected=2)


@pytest.mark.slow
def test_inductor_compiled_model_matches_the_eager_in_place_model():
    x = torch.randn(16, 8)
    fp32 = mlp().eval()(x)
    model = convert(mlp().eval())
    expected = model(x)
    out = torch.compile(model)(x)   # the default backend: inductor, around the conversion's graphs
    assert_only_the_hidden_call_breaks()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4)   # measured: identical
    assert not torch.equal(out, fp32)   # bf16 rounding shows: it ran low, as the eager in-place model does
    assert_converted_low(model, expected=3)


def test_a_child_restored_after_compile_children_leaves_the_others_explained_and_frozen(fresh_dynamo):
    from amp_compiler.dynamo.compile import compile_children, restore_compiled
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    compile_children(model, "O1", dtype=torch.bfloat16, backend="eager")
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.eval()(x)
    assert {prefix for prefix, _ in amp_compiler.converted.converted_graphs(model)} == {"0", "2"}
    restore_compiled(model[2])   # the user takes one child back
    assert {prefix for prefix, _ in amp_compiler.converted.converted_graphs(model)} == {"0"}
    assert {row["module"].split(".")[0] for row in amp_compiler.explain(model).rows} == {"0"}
    assert amp_compiler.freeze(model) is model and len(compiled_record(model).forwards(model)) == 1
