"""export_onnx writes an inference model (issue 9): on real CNNs and transformers (random init, tiny configs)
it has no more Casts and no more weight bytes than convert_onnx of the fp32 export, keeps softmax and
reductions fp32 and norm statistics fp32, and its outputs match fp32 in ONNX Runtime; eval BatchNorms are
folded into their convolutions on a copy of the model, in-place activations run out of place there.

Each model is exported once (module-scoped fixture): torch.onnx with dynamo is the slow part."""
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
import torch
from torch import nn

import amp_compiler
from amp_compiler.config import make_config
from amp_compiler.frontend import share_module_tree, trace
from amp_compiler.onnx.export import export_fp32_reference, prepare_for_inference
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.fold_batch_norms import find_foldable_batch_norms, fold_batch_norms
from amp_compiler.passes.fx.out_of_place_activations import find_inplace_activations
from onnx_testing import F16, F32, all_nodes, assert_valid, nodes_of, onnx_inputs, run, value_types
from real_models import REAL_MODELS

CNNS = ("tv_resnet18", "tv_mobilenet_v3")
TRANSFORMERS = ("hf_bert_sdpa", "hf_gpt2_sdpa", "nn_transformer_encoder")
# ReduceMean is not here: an average runs low (op_policy "average"; ORT's kernels sum fp16 in fp32).
SOFTMAX_AND_REDUCTIONS = ("Softmax", "LogSoftmax", "ReduceSum", "ReduceSumSquare", "ReduceLogSumExp")
NORMS = ("LayerNormalization", "BatchNormalization", "GroupNormalization", "InstanceNormalization")
FP16_TOLERANCE = 1e-2     # of the output's scale



@pytest.fixture(scope="module", params=CNNS + TRANSFORMERS)
def exported(request, tmp_path_factory):
    name, directory = request.param, tmp_path_factory.mktemp(request.param)
    spec = REAL_MODELS[name]
    model, inputs = spec.build(), onnx_inputs(spec.inputs())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    fp32, converted, exported_path = (str(directory / f) for f in ("fp32.onnx", "convert.onnx", "export.onnx"))
    export_fp32_reference(model, inputs, fp32)
    convert_report = amp_compiler.convert_onnx(fp32, converted, "O1")
    export_report = amp_compiler.export_onnx(model, inputs, exported_path, "O1")
    with torch.no_grad():
        reference = spec.output(model(*inputs)).numpy()
    untouched = dict(model.named_modules()) == modules and \
        all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return SimpleNamespace(name=name, model=model, inputs=inputs, reference=reference, untouched=untouched,
                           convert=(converted, convert_report), export=(exported_path, export_report))


@pytest.mark.slow
def test_export_has_no_more_casts_and_weight_bytes_than_convert_onnx(exported):
    (_, by_convert), (path, by_export) = exported.convert, exported.export
    assert_valid(path)
    assert by_export.casts <= by_convert.casts, (exported.name, by_export.casts, by_convert.casts)
    assert by_export.weight_bytes_after <= by_convert.weight_bytes_after, \
        (exported.name, by_export.weight_bytes_after, by_convert.weight_bytes_after)
    assert by_export.casts == sum(n.op_type == "Cast" for n in all_nodes(onnx.load(path)))


def test_softmax_and_reductions_read_fp32_as_in_convert_onnx(exported):
    seen = {}
    for entry, (path, _) in (("convert", exported.convert), ("export", exported.export)):
        model = onnx.load(path)
        types = value_types(model)
        seen[entry] = sorted((n.op_type, types[n.input[0]]) for n in all_nodes(model)
                             if n.op_type in SOFTMAX_AND_REDUCTIONS)
    assert seen["export"] == seen["convert"]
    assert all(dtype == F32 for _, dtype in seen["export"]), seen["export"]


def test_norms_compute_their_statistics_in_fp32(exported):
    """A norm reads fp32, or is ONNX's mixed kernel: LayerNormalization on low activations with
    stash_type=1 (fp32 mean and variance), what O1 chooses where norms read low activations."""
    model = onnx.load(exported.export[0])
    types = value_types(model)
    for node in all_nodes(model):
        if node.op_type not in NORMS or types[node.input[0]] == F32:
            continue
        stash = next((a.i for a in node.attribute if a.name == "stash_type"), 1)
        assert node.op_type == "LayerNormalization" and stash == 1, f"{node.name} reads fp16 with fp16 statistics"


def test_every_softmax_of_an_exported_transformer_reads_fp32(exported):
    """sdpa is an allow op in torch; torch.onnx writes its attention out with a plain Softmax: fp32, as the
    table says for every softmax (and as convert_onnx does)."""
    model = onnx.load(exported.export[0])
    types = value_types(model)
    softmaxes = nodes_of(model, "Softmax")
    assert all(types[n.input[0]] == F32 and types[n.output[0]] == F32 for n in softmaxes)
    if exported.name in TRANSFORMERS:
        assert softmaxes and exported.export[1].pass_counts["widen_denied_ops"]["denied_nodes_widened"] >= 1


def test_cnn_exports_have_no_batch_norm(exported):
    path, report = exported.export
    assert not nodes_of(onnx.load(path), "BatchNormalization")
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in exported.model.modules())
    assert report.pass_counts["fold_batch_norms"]["batch_norms_folded"] == norms
    assert norms or exported.name not in CNNS


def test_every_weight_is_stored_once_and_embedding_tables_in_fp16(exported):
    """A tied LM head (GPT-2) is one fp16 table, read by the lookup and, through a Transpose, by the head."""
    model = onnx.load(exported.export[0])
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type in (F16, F32) and
               np.prod(t.dims) > 1]
    for i, a in enumerate(weights):
        for b in weights[i + 1:]:
            assert not (a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
            assert not (a.ndim == 2 and a.dtype == b.dtype and a.shape == b.shape[::-1] and np.array_equal(a.T, b))
    stored = {t.name: t.data_type for t in model.graph.initializer}
    tables = [n.input[0] for n in nodes_of(model, "Gather") if n.input[0] in stored]
    assert all(stored[t] == F16 for t in tables)
    if exported.name == "hf_gpt2_sdpa":
        assert tables and exported.export[1].pass_counts["store_tied_weights_once"]["tied_weight_copies_removed"]


def test_outputs_match_fp32_within_fp16_tolerance(exported):
    path = exported.export[0]
    session_inputs = [i.name for i in onnx.load(path).graph.input]
    outputs = run(path, {name: x.numpy() for name, x in zip(session_inputs, exported.inputs)})
    output = next(o for o in outputs if o.shape == exported.reference.shape)
    assert output.dtype == np.float32
    scale = max(float(np.abs(exported.reference).max()), 1e-3)
    assert np.abs(output - exported.reference).max() <= FP16_TOLERANCE * scale


def test_the_users_model_is_untouched(exported):
    assert exported.untouched


# ----------------------------------------------------------------- the inference copy, on small models
class ConvBlock(nn.Module):
    """conv -> bn -> relu_ -> conv -> bn, + residual, relu_ (one ReLU module called twice, as BasicBlock)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


def _calibrated(model: nn.Module) -> nn.Module:
    """Running statistics that are not the identity (mean 0, var 1), so folding has something to fold."""
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def _pairs(model, x):
    gm = trace(model, (x,)).graph_module
    canonicalize(gm)
    return gm, find_foldable_batch_norms(gm)


def test_folding_is_exact_and_leaves_the_model_alone():
    model, x = _calibrated(ConvBlock()), torch.randn(2, 4, 8, 8)
    expected = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _, pairs = _pairs(model, x)
    assert [(p.conv, p.norm) for p in pairs] == [("conv1", "bn1"), ("conv2", "bn2")]
    root = share_module_tree(model)
    result = fold_batch_norms(root, pairs)
    assert result.counts == {"batch_norms_folded": 2}
    assert isinstance(root.bn1, nn.Identity) and isinstance(model.bn1, nn.BatchNorm2d)
    assert root.conv1 is not model.conv1 and model.conv1.bias is None
    torch.testing.assert_close(root(x), expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


class SharedConvOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y             # the conv output has a second reader: not foldable


class NoRunningStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)

    def forward(self, x):
        return self.bn(self.conv(x))      # batch statistics even in eval: not an affine map


class StandardizedConv(nn.Conv2d):
    def forward(self, x):                 # weight standardisation: the weight is transformed in forward
        w = (self.weight - self.weight.mean()) / (self.weight.std() + 1e-5)
        return nn.functional.conv2d(x, w, self.bias)


class CustomConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = StandardizedConv(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


@pytest.mark.parametrize("model_class", [SharedConvOutput, NoRunningStats, CustomConv])
def test_what_cannot_fold_is_left(model_class):
    _, pairs = _pairs(model_class().eval(), torch.randn(2, 3, 4, 4))
    assert pairs == []


class ShapeBranch(nn.Module):
    """torch.fx cannot trace the shape branch: the torch.export front end's ATen graph is analysed."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        if x.shape[0] > 1:
            return torch.relu(self.bn(self.conv(x)))
        return x.sum()


def test_the_torch_export_front_end_graph_folds_too():
    model, x = _calibrated(ShapeBranch()), torch.randn(2, 3, 8, 8)
    gm, pairs = _pairs(model, x)
    assert any(n.op == "call_function" for n in gm.graph.nodes)   # ATen ops, not leaf modules
    assert [(p.conv, p.norm) for p in pairs] == [("conv", "bn")]


@pytest.mark.slow
def test_export_folds_and_matches_the_model(tmp_path):
    model, x = _calibrated(ConvBlock()), torch.randn(2, 4, 8, 8)
    path = str(tmp_path / "block.onnx")
    report = amp_compiler.export_onnx(model, (x,), path)
    assert_valid(path)
    onnx_model = onnx.load(path)
    assert not nodes_of(onnx_model, "BatchNormalization")
    assert report.pass_counts["fold_batch_norms"] == {"batch_norms_folded": 2}
    assert report.pass_counts["out_of_place_activations"] == {"activations_made_out_of_place": 1}
    assert report.casts == 2             # the input and the output: conv, add, relu all fp16
    assert isinstance(model.bn1, nn.BatchNorm2d) and model.relu.inplace
    (out,) = run(path, {onnx_model.graph.input[0].name: x.numpy()})
    expected = model(x).detach().numpy()
    assert np.abs(out - expected).max() <= FP16_TOLERANCE * np.abs(expected).max()


@pytest.mark.slow
def test_a_norm_named_by_a_force_pattern_is_not_folded(tmp_path):
    model, x = _calibrated(ConvBlock()), torch.randn(2, 4, 8, 8)
    path = str(tmp_path / "forced.onnx")
    report = amp_compiler.export_onnx(model, (x,), path, force_fp32=["bn2"])   # must still match something
    assert report.pass_counts["fold_batch_norms"] == {"batch_norms_folded": 1}
    (norm,) = nodes_of(onnx.load(path), "BatchNormalization")
    assert value_types(onnx.load(path))[norm.input[0]] == F32


def test_nothing_is_rewritten_at_o0_or_without_norms_and_in_place_activations():
    model, x = _calibrated(ConvBlock()), torch.randn(2, 4, 8, 8)
    captured = trace(model, (x,))
    code = captured.graph_module.code
    assert prepare_for_inference(captured, make_config("O0")) == (captured, {
        "fold_batch_norms": {"batch_norms_folded": 0}, "out_of_place_activations": {"activations_made_out_of_place": 0}})
    assert captured.graph_module.code == code and isinstance(captured.graph_module.bn1, nn.BatchNorm2d)
    plain = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    assert prepare_for_inference(plain, make_config("O1"))[1]["fold_batch_norms"] == {"batch_norms_folded": 0}


class AliasedWrite(nn.Module):
    """The ReLU writes into a tensor another op reads afterwards: in place, the add sees the ReLU's output."""

    def __init__(self):
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 3, 1), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.conv(x)
        z = self.relu(y)
        return z + y


class ViewWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 3, 1), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.conv(x)
        return self.relu(y.view(-1)), y   # writes through a view of y, which is returned too


def test_in_place_activations_whose_write_is_visible_stay_in_place():
    assert find_inplace_activations(_pairs(ConvBlock().eval(), torch.randn(2, 4, 8, 8))[0]) == ["relu"]
    for model_class in (AliasedWrite, ViewWrite):
        gm, _ = _pairs(model_class().eval(), torch.randn(2, 3, 4, 4))
        assert find_inplace_activations(gm) == []
