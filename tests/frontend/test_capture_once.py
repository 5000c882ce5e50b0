"""One capture per conversion (issue 19): capture (seconds on an LLM) is the only step that traces; everything
after it is a pass on the captured graph. Counted here: torch.fx traces of the front end's tracer and its
torch.export captures (export_graph, which may try several dynamic-dim settings; torch.onnx's exporter captures
the converted graph again, by design, and is not counted).

Before the seam, export_onnx traced a CNN with batch norms three times when a weight exceeded fp16's range
(the inference copy, the conversion, the force_fp32 conversion)."""
import importlib
import warnings

import onnx
import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.config import make_config
from amp_compiler.graph_conversion import compile_graph
from amp_compiler.frontend import capture, share_module_tree
from amp_compiler.frontend.fx_capture import AmpTracer
from amp_compiler.onnx.export import prepare_for_inference
from amp_compiler.passes.fx.fold_batch_norms import ConvBatchNorm, fold_batch_norms
from amp_compiler.passes.fx.out_of_place_activations import ACTIVATION_MODULES, make_out_of_place

frontend_capture = importlib.import_module("amp_compiler.frontend.capture")   # the module, not the function


@pytest.fixture
def captures(monkeypatch):
    counted = {"fx": 0, "torch.export": 0}
    fx_trace, export = AmpTracer.trace, frontend_capture.export_graph

    def counting_trace(self, *args, **kwargs):
        counted["fx"] += 1
        return fx_trace(self, *args, **kwargs)

    def counting_export(*args, **kwargs):
        counted["torch.export"] += 1
        return export(*args, **kwargs)

    monkeypatch.setattr(AmpTracer, "trace", counting_trace)
    monkeypatch.setattr(frontend_capture, "export_graph", counting_export)
    return counted


class ConvNet(nn.Module):
    """conv -> bn -> relu_ -> conv -> bn -> hardswish_ -> pool -> linear: both inference passes apply."""

    def __init__(self, head_peak: float = 1.0):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        self.conv2, self.bn2, self.act = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.Hardswish(inplace=True)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.head.weight[0, 0] = head_peak

    def forward(self, x):
        x = self.act(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))
        return self.head(x.mean((2, 3)))


def _model(head_peak: float = 1.0) -> ConvNet:
    torch.manual_seed(0)
    model = ConvNet(head_peak).eval()
    for norm in (model.bn1, model.bn2):
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    return model


X = torch.randn(2, 3, 12, 12)


def test_convert_captures_once(captures):
    amp_compiler.convert(_model(), "O1", example_inputs=(X,))
    assert captures == {"fx": 1, "torch.export": 0}


@pytest.mark.slow
@pytest.mark.parametrize("head_peak", [1.0, 1e5], ids=["in_range", "weight_beyond_fp16"])
def test_export_onnx_captures_once(captures, tmp_path, head_peak):
    path = str(tmp_path / "net.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = amp_compiler.export_onnx(_model(head_peak), (X,), path)
    assert captures == {"fx": 1, "torch.export": 0}
    assert report.pass_counts["fold_batch_norms"] == {"batch_norms_folded": 2}
    assert report.pass_counts["out_of_place_activations"] == {"activations_made_out_of_place": 2}
    assert not [n for n in onnx.load(path).graph.node if n.op_type == "BatchNormalization"]
    beyond = [w for w in report.warnings if "fp16 max" in w]
    assert (len(beyond) == 1 and "'head' exported in fp32" in beyond[0]) if head_peak > 65504 else not beyond
    # the recompile from the same capture kept the weight exact: the head's Gemm/MatMul reads fp32
    head_rows = [r for r in report.rows if r["module"] == "head" and r["op"] == "linear"]
    assert [r["precision"] for r in head_rows] == (["float32"] if head_peak > 65504 else ["float16"])


class Uncapturable(nn.Module):
    """Data-dependent Python control flow at the top: neither torch.fx nor torch.export captures it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x)


def test_the_children_fallback_captures_each_child_once_with_every_option(captures):
    x = torch.ones(2, 4)
    converted = amp_compiler.convert(Uncapturable(), "O1", example_inputs=(x,), calibration_data=[(x,)],
                                     freeze=True, deny_ops=["linear"])
    # the model itself: one fx attempt and one torch.export attempt; then one fx capture per child
    assert captures == {"fx": 3, "torch.export": 1}
    for child in (converted.a, converted.b):
        assert child.meta["amp"]["frozen"] is not None                       # freeze reached the children
        assert {r["dtype"] for r in amp_compiler.explain(child).rows if r["op"] == "linear"} == {"float32"}
        assert any(f.get("range") for f in (n.meta.get("amp", {}) for n in child.graph.nodes))   # calibrated


def test_one_capture_compiles_many_times_and_stays_as_captured():
    model = _model()
    captured = capture(model, (X,))
    code = captured.graph_module.code
    o1, o2 = make_config("O1"), make_config("O2", dtype=torch.bfloat16)
    first, second, again = compile_graph(captured, o1), compile_graph(captured, o2), compile_graph(captured, o1)
    assert captured.graph_module.code == code
    assert not any(n.meta.get("amp", {}).get("precision") for n in captured.graph_module.graph.nodes)
    assert first.code == again.code != second.code
    reference = amp_compiler.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(X,))
    assert second.code == reference.code
    assert amp_compiler.explain(second).rows == amp_compiler.explain(reference).rows
    torch.testing.assert_close(second(X), reference(X))


class Block(nn.Module):
    def __init__(self, activation: nn.Module):
        super().__init__()
        self.conv, self.bn, self.act, self.out = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), activation, \
            nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.out(self.act(self.bn(self.conv(x)))) + 1


def _in_place(cls) -> nn.Module:
    return nn.Threshold(0.1, 0.0, inplace=True) if cls is nn.Threshold else cls(inplace=True)


@pytest.mark.parametrize("activation", ACTIVATION_MODULES, ids=lambda cls: cls.__name__)
def test_the_inference_passes_give_the_graph_a_capture_of_the_edited_model_gives(activation):
    """Folding and out-of-place activations as passes on the captured graph: the same code, the same
    decisions as the module-tree edits followed by a new capture (what export_onnx did before)."""
    model, config = Block(_in_place(activation)).eval(), make_config("O1")
    captured, counts = prepare_for_inference(capture(model, (X,)), config)
    assert counts == {"fold_batch_norms": {"batch_norms_folded": 1},
                      "out_of_place_activations": {"activations_made_out_of_place": 1}}
    edited = share_module_tree(model)
    fold_batch_norms(edited, [ConvBatchNorm("conv", "bn", ("conv", "bn"))])
    make_out_of_place(edited, ["act"])
    recaptured = capture(edited, (X,))
    assert captured.graph_module.code == recaptured.graph_module.code
    assert (captured.leaves, captured.hooked) == (recaptured.leaves, recaptured.hooked)
    compiled, reference = compile_graph(captured, config), amp_compiler.convert(edited, "O1", example_inputs=(X,))
    assert compiled.code == reference.code
    assert amp_compiler.explain(compiled).rows == amp_compiler.explain(reference).rows
    assert isinstance(model.bn, nn.BatchNorm2d) and model.act.inplace      # the user's model as it was


class ShapeBranchNet(ConvNet):
    """ConvNet behind a branch on the input's shape: torch.fx cannot trace it, torch.export captures ATen ops."""

    def __init__(self, dropout: bool = False):
        super().__init__()
        self.drop = nn.Dropout(0.1) if dropout else nn.Identity()

    def forward(self, x):
        if x.shape[0] > 1:
            x = self.act(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))
            return self.head(self.drop(x.mean((2, 3))))
        return x.sum()


def _shape_branch_net(dropout: bool = False) -> ShapeBranchNet:
    model = ShapeBranchNet(dropout)
    model.load_state_dict(_model().state_dict(), strict=False)
    return model.eval()


def test_export_onnx_of_a_torch_export_capture_captures_once(captures, tmp_path):
    model = _shape_branch_net()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = amp_compiler.export_onnx(model, (X,), str(tmp_path / "net.onnx"))
    assert captures == {"fx": 1, "torch.export": 1}   # the fx attempt that fails, the one torch.export capture
    assert report.pass_counts["fold_batch_norms"] == {"batch_norms_folded": 2}
    assert not [n for n in onnx.load(str(tmp_path / "net.onnx")).graph.node if n.op_type == "BatchNormalization"]
    assert isinstance(model.bn1, nn.BatchNorm2d) and model.conv1.bias is None   # the user's model as it was
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dropout, force", [(False, ()), (True, ()), (False, ("bn2",))],
                         ids=["all_folded", "dropout_keeps_the_flag", "one_norm_forced"])
def test_the_aten_graph_fold_gives_the_graph_a_capture_of_the_folded_model_gives(dropout, force):
    """torch.export capture: the ATen graph folded in place is the one a second capture of the folded model gave
    (same code and node names, notes, compiled decisions), whether the train flag stays read or not."""
    model, config = _shape_branch_net(dropout), make_config("O1", force_fp32=force)
    captured, counts = prepare_for_inference(capture(model, (X,)), config)
    assert captured.frontend == "torch.export" and captured.model is model
    folded = [pair for pair in (("conv1", "bn1"), ("conv2", "bn2")) if pair[1] not in force]
    assert counts["fold_batch_norms"] == {"batch_norms_folded": len(folded)}
    edited = share_module_tree(model)
    fold_batch_norms(edited, [ConvBatchNorm(conv, norm, (conv, norm)) for conv, norm in folded])
    recaptured = capture(edited, (X,))
    assert captured.graph_module.code == recaptured.graph_module.code
    assert (captured.notes, captured.hooked, captured.leaves) == (recaptured.notes, recaptured.hooked, recaptured.leaves)
    compiled, reference = compile_graph(captured, config), compile_graph(recaptured, config)
    assert compiled.code == reference.code
    assert amp_compiler.explain(compiled).rows == amp_compiler.explain(reference).rows
    torch.testing.assert_close(compiled(X), reference(X), rtol=0, atol=0)
    assert isinstance(model.bn1, nn.BatchNorm2d) and model.conv1.bias is None   # the user's model as it was


def test_export_onnx_of_a_model_no_front_end_captures_names_it(tmp_path):
    # convert() would run such a model as written with its children converted; an ONNX file needs one graph
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 2
            return self.fc(x)

    with pytest.raises(amp_compiler.TracingError, match="export_onnx needs DataDependent as one graph"):
        amp_compiler.export_onnx(DataDependent().train(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
