"""The model's own upcast is honoured at every level (passes/painting/keep_upcasts_fp32.py): the ops that
compute on `x.float()` (any spelling) stay fp32 up to the model's cast back, the cast is not undone by a cast
to the low dtype, and explain names the cast per node; fx.symbolic_trace, torch.export (HF LlamaRMSNorm)
and export_onnx alike."""
import onnx
import pytest
import torch
from torch import nn

from amp_compiler import convert, export_onnx
from amp_compiler.passes.node_facts import facts
from onnx_testing import F16, F32, value_types

WIDTH = 16
SPELLINGS = {"float": lambda h: h.float(), "to": lambda h: h.to(torch.float32),
             "type": lambda h: h.type(torch.float32), "to_dtype": lambda h: h.to(dtype=torch.float32)}


class Upcast(nn.Module):
    """A bounded pointwise block the model computes in fp32, then casts back to its input's dtype."""

    def __init__(self, spelling: str):
        super().__init__()
        self.up, self.down, self.spelling = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), spelling

    def forward(self, x):
        h = self.up(x)
        u = SPELLINGS[self.spelling](h)
        v = torch.tanh(u) * 2.0 + 1.0
        return self.down(v.to(h.dtype))


def _facts_by_op(gm):
    return {facts(n)["op"]: facts(n) for n in gm.graph.nodes if facts(n).get("op") in ("tanh", "mul", "add", "linear")}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_ops_on_the_models_upcast_stay_fp32_at_every_level(spelling, level):
    gm = convert(Upcast(spelling).eval(), level, example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16)
    assert gm.meta["amp"]["frontend"] == "fx.symbolic_trace"
    by_op = _facts_by_op(gm)
    for op in ("tanh", "mul", "add"):
        assert by_op[op]["precision"] == "fp32", (op, by_op[op]["rule"])
        assert by_op[op]["rule"].startswith("upcast: the model's own ."), by_op[op]["rule"]
    assert by_op["linear"]["precision"] == "low"   # a matmul on the upcast value runs low, as under autocast


def test_the_upcast_is_not_cast_back_to_the_low_dtype():
    gm = convert(Upcast("float").eval(), "O2", example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16)
    upcast = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "float")
    assert facts(upcast)["dtype"] == torch.float32
    assert [facts(u)["op"] for u in upcast.users] == ["tanh"], "the upcast's value is read through a cast"
    assert "the model's own .float() at float" in facts(next(iter(upcast.users)))["rule"]


class AddsALowValue(nn.Module):
    """At O1 the add of the upcast and a matmul's output sits between two matmuls: painted low, the upcast undone."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.c(self.a(x).float() + self.b(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_does_not_paint_an_op_on_the_upcast_low(dtype):
    gm = convert(AddsALowValue().eval(), "O1", example_inputs=(torch.randn(2, WIDTH),), dtype=dtype)
    add = next(n for n in gm.graph.nodes if facts(n).get("op") == "add")
    assert facts(add)["precision"] == "fp32", facts(add)["rule"]
    assert "the model's own .float()" in facts(add)["rule"]


def test_a_node_the_user_forced_low_stays_low():
    gm = convert(Upcast("float").eval(), "O2", example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16,
                 force_low=["tanh"])
    by_op = _facts_by_op(gm)
    assert by_op["tanh"]["precision"] == "low" and by_op["mul"]["precision"] == "fp32"


def test_a_cast_of_a_bool_is_no_upcast():
    class MaskScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(WIDTH, WIDTH)

        def forward(self, x, mask):
            return self.up(x) * mask.float()

    gm = convert(MaskScale().eval(), "O2", example_inputs=(torch.randn(2, WIDTH), torch.ones(2, WIDTH, dtype=torch.bool)),
                 dtype=torch.float16)
    mul = next(n for n in gm.graph.nodes if facts(n).get("op") == "mul")
    assert facts(mul)["precision"] == "low", facts(mul)["rule"]


def _llama():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      use_cache=False)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def test_llama_rms_norm_upcast_is_honoured_through_torch_export():
    gm = convert(_llama(), "O2", example_inputs=(torch.randint(0, 96, (2, 8)),), dtype=torch.float16)
    assert gm.meta["amp"]["frontend"] == "torch.export"
    norm = [facts(n) for n in gm.graph.nodes if facts(n).get("module") == "model.layers.0.input_layernorm"
            and facts(n).get("precision")]
    statistics = [amp for amp in norm if amp["op"] in ("pow", "mean", "add", "rsqrt")]
    assert len(statistics) == 4 and all(amp["precision"] == "fp32" for amp in statistics), norm
    assert all(amp["rule"].startswith("upcast: the model's own .to(float32) at to_") for amp in statistics)
    # the cast back (hidden_states.to(input_dtype), float32 at capture) ends it: the weight multiply runs low
    assert [amp["precision"] for amp in norm if amp["op"] == "mul"] == ["fp32", "low"]
    # the residual add reads the no-op cast's output in the export graph, but is the decoder layer's: low
    residual = [facts(n) for n in gm.graph.nodes if facts(n).get("module") == "model.layers.0" and facts(n).get("op") == "add"]
    assert residual and all(amp["precision"] == "low" for amp in residual)


def test_export_onnx_writes_the_ops_on_the_upcast_in_fp32(tmp_path):
    path = str(tmp_path / "o2.onnx")
    export_onnx(Upcast("float").eval(), (torch.randn(2, WIDTH),), path, level="O2")
    model = onnx.load(path)
    types = value_types(model)
    written = {n.op_type: types[n.output[0]] for n in model.graph.node if n.op_type in ("Tanh", "Gemm")}
    assert written == {"Tanh": F32, "Gemm": F16}
