"""Hugging Face's keep-in-fp32 lists are honoured at every level, as a force_fp32 of the user would be:
`_keep_in_fp32_modules` in float16 and `_keep_in_fp32_modules_strict` in float16 and bfloat16 (as
from_pretrained keeps them), matched as dotted components of the module path, through convert(),
convert(inplace=True) and export_onnx, with the list named in explain."""
import onnx
import pytest
import torch
from torch import nn

from amp_compiler import convert, export_onnx
from amp_compiler.config import keep_in_fp32_modules
from amp_compiler.dynamo import graphs as dynamo_graphs
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import names_module
from onnx_testing import F16, F32, value_types
from real_models import REAL_MODELS

WIDTH = 16


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class KeepsWo(nn.Module):
    """A model that says what it must not run low, as a PreTrainedModel does (T5: "wo")."""
    _keep_in_fp32_modules = ["wo"]
    _keep_in_fp32_modules_strict = ["head"]

    def __init__(self):
        super().__init__()
        self.ff, self.head, self.wordy = FeedForward(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.wordy(self.ff(x)))


def _linears(gm) -> dict[str, dict]:
    return {facts(n)["module"]: facts(n) for n in gm.graph.nodes if facts(n).get("op") == "linear"}


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_keep_in_fp32_modules_stay_fp32_in_float16_at_every_level(level):
    gm = convert(KeepsWo().eval(), level, example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16)
    linears = _linears(gm)
    assert {path: amp["precision"] for path, amp in linears.items()} == \
        {"ff.wi": "low", "ff.wo": "fp32", "head": "fp32", "wordy": "low"}   # "wordy" holds "wo", not as a component
    assert linears["ff.wo"]["rule"].startswith("model: KeepsWo._keep_in_fp32_modules names 'wo'")
    assert "_keep_in_fp32_modules_strict names 'head'" in linears["head"]["rule"]


def test_only_the_strict_list_applies_in_bfloat16():
    gm = convert(KeepsWo().eval(), "O2", example_inputs=(torch.randn(2, WIDTH),), dtype=torch.bfloat16)
    assert {path: amp["precision"] for path, amp in _linears(gm).items()} == \
        {"ff.wi": "low", "ff.wo": "low", "head": "fp32", "wordy": "low"}


def test_the_users_force_low_wins_over_the_models_list():
    gm = convert(KeepsWo().eval(), "O2", example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16,
                 force_low=["ff.wo"])
    assert _linears(gm)["ff.wo"]["precision"] == "low"


def test_fragments_match_whole_dotted_components():
    assert names_module("wo", "decoder.block.0.layer.2.DenseReluDense.wo")
    assert names_module("encoder.embed", "model.encoder.embed")
    assert not names_module("wo", "word_embeddings") and not names_module("wo", "ff.wo_extra")
    assert not names_module("encoder.embed", "encoder.embed_positions")


def test_in_place_conversion_keeps_the_listed_modules_fp32():
    model = KeepsWo().eval()
    convert(model, "O2", inplace=True, example_inputs=(torch.randn(2, WIDTH),), dtype=torch.float16)
    linears = {path: amp["precision"] for gm in dynamo_graphs(model) for path, amp in _linears(gm).items()}
    assert linears == {"ff.wi": "low", "ff.wo": "fp32", "head": "fp32", "wordy": "low"}, linears


def test_export_onnx_writes_the_listed_modules_in_fp32(tmp_path):
    path = str(tmp_path / "o2.onnx")
    export_onnx(KeepsWo().eval(), (torch.randn(2, WIDTH),), path, level="O2")
    model = onnx.load(path)
    types = value_types(model)
    gemms = [types[n.output[0]] for n in model.graph.node if n.op_type in ("Gemm", "MatMul")]
    assert sorted(gemms) == sorted([F16, F32, F32, F16]), gemms


@pytest.mark.slow
def test_hugging_face_t5_keeps_its_wo_fp32():
    spec = REAL_MODELS["hf_t5"]
    model = spec.build()
    assert dict(keep_in_fp32_modules(model, torch.float16)).keys() == {"wo"}
    gm = convert(model, "O2", example_inputs=spec.inputs(), dtype=torch.float16)
    wo = [amp for path, amp in _linears(gm).items() if path.endswith(".wo")]
    assert len(wo) == 4 and all(amp["precision"] == "fp32" and "_keep_in_fp32_modules names 'wo'" in amp["rule"]
                                for amp in wo)
