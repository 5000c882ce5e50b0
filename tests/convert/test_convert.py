"""convert(): levels, overrides, user rules, the result's contract, and every error it raises."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler import convert, explain
from amp_testing import assert_cast_invariants, assert_close_to_fp32, cast_nodes, precision_by_op


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ffn = nn.Linear(dim, dim)
        self.ffn_out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = torch.softmax(self.attn(x), dim=-1)
        return self.norm(x + self.drop(self.ffn_out(F.gelu(self.ffn(h)))))


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList([Block(dim), Block(dim)])})
        self.bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for layer in self.encoder["layers"]:
            x = layer(x)
        return self.head(self.bn(x))


@pytest.fixture


def net():
    torch.manual_seed(0)
    return Net()


X = torch.randn(6, 8)


def test_o1_paints_by_the_policy_and_matches_fp32(net):
    gm = convert(net, "O1")
    painted = precision_by_op(gm)
    assert painted["linear"] == {"low"}
    assert painted["softmax"] == painted["layer_norm"] == {"fp32"}
    # A batch norm between low ops reads the low activations (mixed kernel: fp32 weights and statistics);
    # this one reads the fp32 layer norm's output, so it stays fp32 rather than cast it down
    # (tests/convert/test_mixed_norms.py). With keep_batchnorm_fp32=False every norm runs fp32 between casts.
    assert painted["batch_norm"] == {"fp32"}
    assert [r["rule"].startswith("infer: fed by fp32 op encoder_layers_1_norm") for r in explain(gm).rows
            if r["op"] == "batch_norm"] == [True]
    conv_bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))
    assert precision_by_op(convert(conv_bn, "O1"))["batch_norm"] == {"low"}
    assert precision_by_op(convert(conv_bn, "O1", keep_batchnorm_fp32=False))["batch_norm"] == {"fp32"}
    assert painted["gelu"] == {"low"}  # between two matmuls: the gap is closed
    net.eval(), gm.eval()
    assert_close_to_fp32(gm(X), net(X), torch.float16)
    assert_cast_invariants(gm)


def test_o0_changes_nothing(net):
    gm = convert(net, "O0")
    assert cast_nodes(gm) == []
    net.eval(), gm.eval()
    assert torch.equal(gm(X), net(X))


def test_o2_keeps_norm_weights_and_statistics_fp32_and_o3_lowers_everything(net):
    gm = convert(net, "O2")
    o2 = precision_by_op(gm)
    assert o2["softmax"] == o2["gelu"] == o2["linear"] == {"low"}
    # Norms run on low-precision activations with fp32 weights and fp32 statistics (mixed kernels):
    # no cast of the activations up and back down, and no cast of their parameters.
    assert o2["layer_norm"] == o2["batch_norm"] == {"low"}
    norm_rows = [r for r in explain(gm).rows if r["op"] in ("layer_norm", "batch_norm")]
    assert all("fp32 weights and statistics" in r["rule"] for r in norm_rows)
    assert not [c for c in cast_nodes(gm) if c.args[0].op == "get_attr" and "norm" in c.args[0].target]
    o3 = precision_by_op(convert(net, "O3"))
    assert all(p == {"low"} for p in o3.values())
    rms = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, 8))  # no mixed kernel: fp32 with casts
    assert precision_by_op(convert(rms, "O2"))["rms_norm"] == {"fp32"}
    assert precision_by_op(convert(net, "O2", keep_batchnorm_fp32=False))["batch_norm"] == {"low"}
    o3_kept = convert(net, "O3", keep_batchnorm_fp32=True)
    assert "fp32 weights and statistics" in next(r["rule"] for r in explain(o3_kept).rows if r["op"] == "layer_norm")


def test_losses_stay_fp32_at_o2():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            return F.cross_entropy(self.fc(x), y)

    painted = precision_by_op(convert(WithLoss(), "O2"))
    assert painted["cross_entropy"] == {"fp32"} and painted["linear"] == {"low"}


def test_bf16_and_dtype_spellings(net):
    for spelling in (torch.bfloat16, "bf16", "bfloat16"):
        gm = convert(net, "O1", dtype=spelling)
        assert gm.meta["amp"]["dtype"] == "bfloat16"
    assert convert(net, "O1", cast_model_type=torch.bfloat16).meta["amp"]["dtype"] == "bfloat16"
    gm = convert(net, "O1", dtype=torch.bfloat16)
    assert {n.args[1] for n in cast_nodes(gm)} <= {torch.bfloat16, torch.float32}


def test_auto_picks_bf16_on_cpu_and_reports_the_choice(net):
    gm = convert(net, "auto")
    expected = "float16" if torch.cuda.is_available() else "bfloat16"
    assert gm.meta["amp"]["dtype"] == expected
    assert gm.meta["amp"]["level"] == "O1" and gm.meta["amp"]["requested_level"] == "auto"
    assert "(asked auto)" in str(explain(gm))


def test_result_shares_parameters_and_never_changes_the_model(net):
    before = copy.deepcopy(net.state_dict())
    params = list(net.parameters())
    net.train()
    gm = convert(net, "O2")
    gm.eval()
    assert net.training and all(m.training for m in net.modules())
    assert [p for p in gm.parameters()] == params  # same objects: optimizers on model.parameters() train it
    assert list(gm.state_dict()) == list(net.state_dict())
    assert all(torch.equal(before[k], v) and v.dtype == before[k].dtype for k, v in net.state_dict().items())
    assert all(p.dtype == torch.float32 for p in net.parameters())
    gm.load_state_dict(before)  # checkpoints load both ways
    net.load_state_dict(gm.state_dict())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_converting_with_example_inputs_leaves_every_buffer_alone(net, level):
    # The fx path runs the graph on fake example inputs to learn dtypes; a train-mode BatchNorm counts a
    # step (num_batches_tracked += 1) on every call, which must not reach the user's real buffer.
    net.train()
    before = copy.deepcopy(net.state_dict())
    convert(net, level, example_inputs=(X,))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_optimizer_on_model_parameters_trains_the_converted_graph(net):
    gm = convert(net, "O1")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    target = torch.randint(0, 3, (6,))
    weight = net.head.weight.detach().clone()
    loss = F.cross_entropy(gm(X), target)
    loss.backward()
    assert net.head.weight.grad.dtype == torch.float32
    opt.step()
    assert not torch.equal(weight, net.head.weight)


def test_train_eval_behave_as_on_the_original(net):
    gm = convert(net, "O1")
    gm.train()
    assert not torch.equal(gm(X), gm(X))  # dropout active
    stats = net.bn.running_mean.clone()
    gm.eval()
    assert torch.equal(gm(X), gm(X))
    assert torch.equal(stats, net.bn.running_mean)  # batch norm statistics frozen in eval
    gm.train()
    gm(X)
    assert not torch.equal(stats, net.bn.running_mean)


def test_call_signature_and_keep_io_types(net):
    gm = convert(net, "O1")
    net.eval(), gm.eval()
    assert gm(x=X).dtype == torch.float32
    low = convert(net, "O1", keep_io_types=False)
    low.eval()
    assert low(X).dtype == torch.float16


def test_casts_are_shared_and_visible_in_the_code(net):
    gm = convert(net, "O1")
    assert "amp_cast" in gm.code
    casts = cast_nodes(gm)
    assert gm.meta["amp"]["casts"] == explain(gm).totals["casts"] == len(casts)
    for cast in casts:
        assert cast.meta["amp_role"] == "cast"
    # x feeds layer 0's attn linear (low) and its residual add (fp32): exactly one fp16 cast of x.
    x_casts = [c for c in casts if c.args[0].op == "placeholder"]
    assert len(x_casts) == 1


def test_user_op_lists_override_the_table_for_one_call(net):
    assert precision_by_op(convert(net, "O1", deny_ops=["linear"]))["linear"] == {"fp32"}
    assert precision_by_op(convert(net, "O1", allow_ops=["softmax"]))["softmax"] == {"low"}
    assert precision_by_op(convert(net, "O1"))["softmax"] == {"fp32"}  # nothing leaked between calls
    rows = explain(convert(net, "O1", deny_ops=["linear"])).rows
    assert any(r["rule"] == "deny: user rule: linear in deny_ops" for r in rows)


def test_force_precision_by_module_glob_and_node_name(net):
    gm = convert(net, "O1", force_fp32=["encoder.layers.*.attn"])
    for row in explain(gm).rows:
        if row["module"].endswith(".attn") and row["op"] == "linear":
            assert row["dtype"] == "float32" and "force_fp32 'encoder.layers.*.attn'" in row["rule"]
        elif row["op"] == "linear":
            assert row["dtype"] == "float16"
    gm = convert(net, "O1", force_low=["softmax_1"])
    softmaxes = {r["node"]: r["dtype"] for r in explain(gm).rows if r["op"] == "softmax"}
    assert softmaxes == {"softmax": "float32", "softmax_1": "float16"}


def test_unknown_ops_stay_fp32_and_are_reported():
    class UsesCustom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.sinc(self.fc(x)))   # sinc: not in the policy table

    gm = convert(UsesCustom(), "O1")
    report = explain(gm)
    assert report.totals["unknown_ops"] == ["sinc"]
    assert [r["dtype"] for r in report.rows if r["op"] == "sinc"] == ["float32"]
    assert "1 unknown ops: sinc" in str(report)
    gm = convert(UsesCustom(), "O1", infer_ops=["sinc"])
    assert explain(gm).totals["unknown_ops"] == []


def test_explain_report_lists_every_node_with_op_dtype_and_rule(net):
    report = explain(convert(net, "O1"))
    text = str(report)
    assert ("leaf modules kept whole (one call each in the graph, not traced into): bn, head, "
            "encoder.layers.[0-1].{attn,drop,ffn,ffn_out,norm} (12 modules)") in " ".join(text.split())   # wrapped
    assert all(r["rule"] for r in report.rows)
    totals = report.totals
    assert totals["nodes"] == sum(totals["nodes_per_dtype"].values()) > 0
    assert f"{totals['casts']} casts" in text
    with pytest.raises(ValueError, match="returned by amp_compiler.convert"):
        explain(torch.fx.symbolic_trace(net))


@pytest.mark.parametrize("kwargs, message", [
    ({"level": "O4"}, "level must be one of O0, O1, O2, O3"),
    ({"level": "O1", "dtype": torch.float32}, "dtype must be torch.float16 or torch.bfloat16"),
    ({"level": "O1", "dtype": "int8"}, "dtype must be"),
    ({"level": "O1", "keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32 must be True, False or None"),
    ({"level": "O1", "keep_io_types": 1}, "keep_io_types must be True or False"),
    ({"level": "O1", "fp16_everything": True}, "unknown option.*valid options: keep_batchnorm_fp32"),
    ({"level": "O1", "allow_ops": ["gelu"], "deny_ops": ["gelu"]}, "'gelu' is in both allow_ops and deny_ops"),
    ({"level": "O1", "force_fp32": ["head"], "force_low": ["head"]}, "in both force_fp32 and force_low"),
    ({"level": "O1", "force_fp32": ["decoder.*"]}, "matched no module path or node name"),
    ({"level": "O1", "force_fp32": ["encoder.*"], "force_low": ["encoder.layers.0.*"]}, "force_fp32 and force_low patterns"),
    ({"level": "O1", "allow_ops": "gelu softmax".split(" ")[0:1] + [3]}, "allow_ops must be a list of strings"),
    ({"level": "O1", "dtype": torch.float16, "cast_model_type": torch.bfloat16}, "disagree"),
])


def test_bad_options_are_value_errors_that_list_valid_values(net, kwargs, message):
    with pytest.raises(ValueError, match=message):
        convert(net, **kwargs)


def test_not_a_module_and_bad_example_inputs():
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        convert(lambda x: x)
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        convert(nn.Linear(2, 2), example_inputs=torch.randn(2))


def test_public_api_surface():
    assert amp_compiler.default_lists("deny")[:3] == sorted(amp_compiler.default_lists("deny"))[:3]
    for name in ("convert", "explain", "TracingError"):
        assert name in amp_compiler.__all__
