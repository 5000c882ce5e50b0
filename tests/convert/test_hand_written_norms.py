"""A norm written by hand is a norm (passes/painting/keep_norms_fp32.py): where the level keeps norms fp32
(O1 by the policy, O2 by keep_batchnorm_fp32), the statistics and the normalisation of an RMSNorm or a
LayerNorm spelled as pointwise ops stay fp32, on fx, through export_onnx and through convert_onnx; where the
level runs norms low (O3, keep_batchnorm_fp32=False) they stay as painted."""
import onnx
import pytest
import torch
from torch import nn

from amp_compiler import convert, export_onnx
from amp_compiler.onnx.convert import convert_onnx
from amp_compiler.passes.node_facts import facts
from onnx_testing import F16, F32, value_types

WIDTH = 16


class RMSNorm(nn.Module):   # Llama's, without its upcast
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class SquareRMSNorm(nn.Module):   # x * x, x / sqrt
    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class LayerNorm(nn.Module):   # BERT's and ConvNeXt's written by hand
    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(WIDTH)), nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + 1e-5)) + self.bias


class VarLayerNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)


class StdLayerNorm(nn.Module):   # the Annotated Transformer's
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)


class GemmaRMSNorm(nn.Module):   # (1 + weight), 1 / sqrt
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + self.weight)


class Block(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(WIDTH, WIDTH), norm, nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


NORMS = {"rms": (RMSNorm, "RMSNorm", {"pow", "mean", "add", "rsqrt", "mul"}),
         "square_rms": (SquareRMSNorm, "RMSNorm", {"mul", "mean", "add", "sqrt", "div"}),
         "layer_norm": (LayerNorm, "LayerNorm", {"mean", "sub", "pow", "add", "sqrt", "div"}),
         "var": (VarLayerNorm, "LayerNorm", {"mean", "sub", "var", "add", "sqrt", "div"}),
         "std": (StdLayerNorm, "LayerNorm", {"mean", "sub", "std", "add", "div"}),
         "gemma": (GemmaRMSNorm, "RMSNorm", {"pow", "mean", "add", "sqrt", "div", "mul"})}


def norm_nodes(gm):
    return {n.name: facts(n) for n in gm.graph.nodes if facts(n).get("module") == "norm" and facts(n).get("precision")}


def _converted(norm: str, level: str, **options):
    return convert(Block(NORMS[norm][0]()).eval(), level, example_inputs=(torch.randn(2, WIDTH),), **options)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("level, dtype", [("O2", torch.float16), ("O2", torch.bfloat16), ("O1", torch.float16)])
def test_hand_written_norm_stays_fp32_where_the_level_keeps_norms(norm, level, dtype):
    _, kind, ops = NORMS[norm]
    nodes = norm_nodes(_converted(norm, level, dtype=dtype))
    kept = {name: amp for name, amp in nodes.items() if amp["rule"].startswith(f"norm: a hand-written {kind}")}
    assert {amp["op"] for amp in kept.values()} == ops, {n: (a["op"], a["precision"], a["rule"]) for n, a in nodes.items()}
    assert all(amp["precision"] == "fp32" for amp in kept.values())
    assert all("the level keeps norms" in amp["rule"] for amp in kept.values())


def test_the_affine_after_a_hand_written_norm_follows_the_level():
    nodes = norm_nodes(_converted("layer_norm", "O2", dtype=torch.float16))
    affine = [amp for amp in nodes.values() if not amp["rule"].startswith("norm:")]
    assert sorted(amp["op"] for amp in affine) == ["add", "mul"]   # weight * x + bias: low, as O2 paints it
    assert all(amp["precision"] == "low" for amp in affine)


@pytest.mark.parametrize("level, options", [("O3", {}), ("O2", {"keep_batchnorm_fp32": False}),
                                            ("O2", {"allow_ops": ["rms_norm"]})])
def test_hand_written_norm_runs_low_where_the_level_runs_norms_low(level, options):
    nodes = norm_nodes(_converted("rms", level, dtype=torch.float16, **options))
    assert nodes and all(amp["precision"] == "low" for amp in nodes.values()), nodes


def test_a_mean_of_squares_that_normalises_nothing_is_no_norm():
    class Energy(nn.Module):   # pow -> mean -> sqrt read as a value, not to scale x
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            h = self.up(x)
            return h + torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    gm = convert(Energy().eval(), "O2", example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16)
    assert not [n for n in gm.graph.nodes if (facts(n).get("rule") or "").startswith("norm:")]


def test_a_node_the_user_forced_low_stays_low():
    gm = _converted("rms", "O2", dtype=torch.float16, force_low=["rsqrt"])
    nodes = norm_nodes(gm)
    assert nodes["rsqrt"]["precision"] == "low" and nodes["pow_1"]["precision"] == "fp32"


def _float_types(path: str, op_types) -> dict[str, int]:
    model = onnx.load(path)
    types = value_types(model)
    return {n.op_type: types[n.output[0]] for n in model.graph.node if n.op_type in op_types}


STATISTICS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal")


def test_export_onnx_writes_the_hand_written_norm_in_fp32(tmp_path):
    path = str(tmp_path / "o2.onnx")
    export_onnx(Block(RMSNorm()).eval(), (torch.randn(2, WIDTH),), path, level="O2")
    types = _float_types(path, (*STATISTICS, "Gemm"))
    assert types == {"Pow": F32, "ReduceMean": F32, "Sqrt": F32, "Reciprocal": F32, "Gemm": F16}


def test_convert_onnx_keeps_the_hand_written_norm_of_an_fp32_file_fp32(tmp_path):
    source, target = str(tmp_path / "fp32.onnx"), str(tmp_path / "o2.onnx")
    torch.onnx.export(Block(RMSNorm()).eval(), (torch.randn(2, WIDTH),), source, dynamo=True, verbose=False)
    convert_onnx(source, target, level="O2")
    types = _float_types(target, (*STATISTICS, "Gemm"))
    assert types == {"Pow": F32, "ReduceMean": F32, "Sqrt": F32, "Reciprocal": F32, "Gemm": F16}


# A norm written with torch.linalg.vector_norm (ScaleNorm, L2-normalised features) is a hand-written norm too: run
# float16 at O2 fp16, ||h|| overflows where O1 (vector_norm denied as a reduction) and fp32 give 1.0.
class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar, 2019): g * x / ||x||, a hand-written norm through torch.linalg.vector_norm."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.tensor(width ** 0.5))

    def forward(self, x):
        h = self.proj(x)
        return self.scale * (h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp(min=1e-5))


def test_o2_fp16_keeps_a_vector_norm_scalenorm_fp32_as_it_keeps_hand_written_rms_norms():
    torch.manual_seed(0)
    model, x = ScaleNorm().eval(), torch.randn(2, 1024)
    with torch.no_grad():
        model.proj.weight.zero_()
        model.proj.bias.fill_(2100.0)          # activations fp16 holds, whose norm it does not
    converted = convert(model, level="O2", dtype=torch.float16, example_inputs=(x,))
    with torch.no_grad():
        torch.testing.assert_close(converted(x).float(), model(x), rtol=1e-2, atol=1e-2)
