"""lower_leaf_modules and infer_dtypes on their own."""
import torch
from torch import nn

from amp_compiler.frontend import trace
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.infer_dtypes import infer_dtypes
from amp_compiler.passes.fx.lower_leaf_modules import lower_leaf_modules
from amp_compiler.passes.fx.runtime import amp_module_call


class Leaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.deconv = nn.ConvTranspose1d(4, 4, 2, stride=2)
        self.norm = nn.BatchNorm1d(4)
        self.gru = nn.GRU(4, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.norm(self.deconv(self.conv(x)))
        out, _ = self.gru(h.transpose(1, 2))
        return self.fc(out)


def painted_low(model, skip=()):
    gm = trace(model).graph_module
    canonicalize(gm)
    for node in gm.graph.nodes:
        node.meta["amp"]["precision"] = "low" if node.op == "call_module" and node.target not in skip else None
    return gm


def test_low_leaves_read_their_weights_through_get_attr_and_norms_stay_modules():
    model = Leaves()
    gm = painted_low(model)
    result = lower_leaf_modules(gm, torch.float16)
    assert result.counts == {"leaf_modules_lowered": 4}  # conv, deconv, gru, fc; the norm keeps its module
    modules = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert modules == ["norm"]
    getters = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"conv.weight", "conv.bias", "deconv.weight", "fc.weight", "fc.bias", "gru"} <= getters
    assert any(n.target is amp_module_call for n in gm.graph.nodes)
    gm.graph.lint()


def test_lowering_alone_changes_no_numbers():
    model = Leaves()
    gm = painted_low(model, skip=("gru",))  # amp_module_call casts inside; the others only expose weights
    lower_leaf_modules(gm, torch.float16)
    gm.recompile()
    model.eval(), gm.eval()
    x = torch.randn(2, 3, 5)
    assert torch.allclose(gm(x), model(x), atol=1e-6)  # lowering alone changes no numbers


def test_fp32_leaves_are_left_alone():
    gm = trace(Leaves()).graph_module
    canonicalize(gm)
    assert lower_leaf_modules(gm, torch.float16).modified is False


def test_amp_module_call_casts_parameters_for_one_call_only():
    gru = nn.GRU(4, 4, batch_first=True)
    out, _ = amp_module_call(gru, torch.bfloat16, torch.randn(1, 2, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in gru.parameters())


def test_dtypes_follow_example_inputs_parameters_and_explicit_casts():
    class Kinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)

        def forward(self, ids, x):
            n = x.size(0)
            return self.emb(ids), x.double() * n, x.half(), ids > 2, torch.zeros(n)

    gm = trace(Kinds()).graph_module
    canonicalize(gm)
    infer_dtypes(gm, (torch.tensor([1]), torch.randn(2)))
    dtypes = {n.name: n.meta["amp"]["dtype"] for n in gm.graph.nodes}
    assert dtypes["ids"] == torch.int64 and dtypes["x"] == torch.float32 and dtypes["size"] is None
    assert dtypes["emb"] == torch.float32 and dtypes["double"] == torch.float64 and dtypes["mul"] == torch.float64
    assert dtypes["half"] == torch.float16 and dtypes["gt"] is None and dtypes["zeros"] == torch.float32
