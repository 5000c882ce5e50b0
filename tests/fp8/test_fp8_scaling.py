"""The fp8 level's scaling as graph nodes (issue 23): fp8_amax / fp8_scale / fp8_delayed_scale / fp8_cast against
references written here, the three recipes' gradients against float64 within fp8's bound (test_fp8.py's module
docstring derives it), delayed histories (roll, max vs most_recent, empty, non-finite, eval, state_dict, the
joint training graph), row-wise scaling on rows that span decades, and the calibration figures' consumer.
"""
import io
import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import amp_compiler
from amp_compiler.passes.fx.fp8_runtime import (E4M3, E5M2, FP8_MAX, Fp8History, fp8_amax, fp8_cast,
                                                fp8_delayed_scale, fp8_linear, fp8_scale, quantize)
from amp_compiler.passes.fx.lower_fp8_matmuls import lower_fp8_matmuls
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.fp8 import Fp8Options
from test_fp8 import (BF16_ROUNDING, SMALLEST_SUBNORMAL, UNIT_ROUNDOFF, assert_within, reference_cast,
                      reference_scale)

SCALING_OPS = ("fp8_amax", "fp8_scale", "fp8_cast")


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the scaling nodes against references ------------------------------------------------------------------------

def test_amax_node_per_tensor_per_row_per_column():
    x = torch.randn(6, 32, generator=_seeded(0)).bfloat16()
    x[2, 5] = -77.0
    magnitudes = x.double().abs()
    assert fp8_amax(x).item() == 77.0 and fp8_amax(x).dtype == torch.float32 and fp8_amax(x).dim() == 0
    assert torch.equal(fp8_amax(x, -1).double(), magnitudes.max(dim=1, keepdim=True).values)
    assert torch.equal(fp8_amax(x, 0).double(), magnitudes.max(dim=0, keepdim=True).values)
    assert fp8_amax(torch.randn(3, 4, 32), -1).shape == (3, 4, 1)   # leading dims kept: one per row
    assert not fp8_amax(torch.randn(4, 4, requires_grad=True)).requires_grad


@pytest.mark.parametrize("margin", [0, 3])
def test_scale_node_is_one_power_of_two_per_row(margin):
    amax = torch.exp(torch.empty(40, 1).uniform_(-20, 20, generator=_seeded(1)))
    amax[3], amax[7] = math.inf, math.nan
    scales = fp8_scale(amax, E4M3, margin)
    expected = torch.tensor([[reference_scale(a, E4M3, margin)] for a in amax.flatten().tolist()])
    torch.testing.assert_close(scales, expected, rtol=0, atol=0)
    assert scales[3].item() == 0 and scales[7].item() == 0


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_node_saturates_and_an_overflow_stays_nan(fp8_dtype):
    limit = FP8_MAX[fp8_dtype]
    values = torch.tensor([1.0, -2.5, 300.0, 1e6, -1e6, 0.0])
    cast = fp8_cast(values, torch.tensor(1.0), fp8_dtype)
    assert cast.dtype == fp8_dtype
    torch.testing.assert_close(cast.double(), reference_cast(values, fp8_dtype), rtol=0, atol=0)
    assert cast.double()[3:5].tolist() == [limit, -limit]   # e4m3 448 (not NaN), e5m2 57344 (not inf)
    with_inf = torch.tensor([1.0, math.inf, -3.0])
    copy = fp8_cast(with_inf, fp8_scale(fp8_amax(with_inf), fp8_dtype), fp8_dtype)
    assert torch.isnan(copy.double()[1]) and copy.double()[0] == 0   # scale 0: the overflow stays visible


# -- delayed scaling ----------------------------------------------------------------------------------------------

def reference_delayed(history: list[float], amax: float, amax_from: str, margin: int):
    """(scale, history after the call) of one training-mode call: the scale from the history before this call
    (its max or newest entry; this call's amax while nothing is recorded), this call's amax rolled in front
    unless it is inf/NaN, which gets scale 0 and is not recorded, or 0 (nothing to record)."""
    past = max(history) if amax_from == "max" else history[0]
    scale = reference_scale(past if past > 0 else amax, E4M3, margin) if math.isfinite(amax) else 0.0
    return scale, ([amax] + history[:-1] if math.isfinite(amax) and amax > 0 else history)


@pytest.mark.parametrize("amax_from", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scale_rolls_its_history(amax_from, margin):
    histories = Fp8History(3).train()
    expected_history = [0.0, 0.0, 0.0]
    amaxes = torch.tensor([5.0, 0.3, 900.0, math.nan, 2.0, math.inf, 0.01, 0.02, 0.03, 7.0, 0.0]).tolist()   # fp32
    scales = []
    for amax in amaxes:
        scale = fp8_delayed_scale(torch.tensor(amax), histories, "x", E4M3, margin, amax_from)
        expected, expected_history = reference_delayed(expected_history, amax, amax_from, margin)
        scales.append(scale.item())
        assert scale.item() == expected, (amax, scale.item(), expected)
        assert histories.x.tolist() == expected_history, amax
    assert histories.w.tolist() == histories.grad.tolist() == [0.0, 0.0, 0.0]   # only x's history moved
    # the figures the recipe is about, spelled out: no warm-up, the delay, and max vs most recent
    assert scales[0] == reference_scale(5.0, E4M3, margin)   # empty history: this call's amax
    assert scales[1] == reference_scale(5.0, E4M3, margin)   # from the history (5.0), not 0.3
    assert scales[2] != reference_scale(900.0, E4M3, margin)   # 900 arrives after its own scale was taken
    assert scales[4] == reference_scale(900.0, E4M3, margin)   # the NaN was not recorded: 900 is the newest
    assert scales[3] == 0.0 and scales[5] == 0.0
    assert histories.x.tolist() == amaxes[-2:-5:-1]   # an empty batch (amax 0) pushed no entry out (7, .03, .02)


def test_delayed_scale_saturates_a_tensor_past_its_history():
    histories = Fp8History(4).train()
    small = torch.full((8,), 0.5)
    fp8_delayed_scale(fp8_amax(small), histories, "w", E4M3)   # records 0.5: next scale 2**9 (0.5 * 512 = 256)
    large = torch.full((8,), 4.0)
    scale = fp8_delayed_scale(fp8_amax(large), histories, "w", E4M3)
    assert scale.item() == 512.0
    assert fp8_cast(large, scale, E4M3).double().tolist() == [448.0] * 8   # 2048 saturates, no NaN
    assert histories.w[:2].tolist() == [4.0, 0.5]


def test_eval_calls_read_histories_and_do_not_record():
    histories = Fp8History(2).train()
    fp8_delayed_scale(torch.tensor(3.0), histories, "x", E4M3)
    histories.eval()
    scale = fp8_delayed_scale(torch.tensor(100.0), histories, "x", E4M3)
    assert scale.item() == reference_scale(3.0, E4M3) and histories.x.tolist() == [3.0, 0.0]


# -- gradients of a converted linear per recipe --------------------------------------------------------------------

def _step(x: torch.Tensor, scale: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """The most each element of x moves when quantized with `scale` (broadcast: per tensor, row or column)."""
    return UNIT_ROUNDOFF[fp8_dtype] * x.abs() + SMALLEST_SUBNORMAL[fp8_dtype] / 2 / scale


def _scale_of(x: torch.Tensor, fp8_dtype, dim=None) -> torch.Tensor:
    """The reference scale of x per tensor, or one per slice along `dim` (kept), float64."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return torch.tensor([reference_scale(a, fp8_dtype) for a in amax.flatten().tolist()],
                        dtype=torch.float64).reshape(amax.shape)


def _bound(a, a_step, b, b_step, roundings: int) -> torch.Tensor:
    moved = (a.abs() + a_step) @ (b.abs() + b_step) - a.abs() @ b.abs()
    return moved + roundings * BF16_ROUNDING * ((a @ b).abs() + moved) + 1e-6 * (a.abs() @ b.abs())


def _linear_model(scaling: str, **options):
    torch.manual_seed(4)
    model = nn.Linear(48, 32)
    with torch.no_grad():
        model.weight.mul_(0.1)
    x = (torch.randn(2, 10, 48, generator=_seeded(5)) * 3).bfloat16()
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16, fp8_scaling=scaling, **options)
    return model, gm.train(), x


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
def test_gradients_of_an_fp8_linear_per_recipe_are_within_the_fp8_bound(scaling):
    model, gm, x = _linear_model(scaling, **({"fp8_history": 4} if scaling == "delayed" else {}))
    x = x.requires_grad_()
    g = (torch.randn(2, 10, 32, generator=_seeded(6)) * 1e-3).bfloat16()
    rows, wd = x.detach().double().reshape(20, 48), model.weight.detach().bfloat16().double()
    bd, grads = model.bias.detach().bfloat16().double(), g.double().reshape(20, 32)
    if scaling == "delayed":   # histories 4x each tensor's amax: scales a quarter (2 binades) of current's
        histories = gm.fp8_history.linear
        for name, value in (("x", rows), ("w", wd), ("grad", grads)):
            getattr(histories, name)[0] = 4 * value.abs().max().item()
    y = gm(x)
    y.backward(g.float())
    if scaling == "rowwise":   # x per row, w per row; dx: g per row, w per column; dw: g, x per column
        sx, sw = _scale_of(rows, E4M3, -1), _scale_of(wd, E4M3, -1)
        dx_steps = _step(grads, _scale_of(grads, E4M3, -1), E4M3), _step(wd, _scale_of(wd, E4M3, 0), E4M3)
        dw_steps = _step(grads, _scale_of(grads, E4M3, 0), E4M3).t(), _step(rows, _scale_of(rows, E4M3, 0), E4M3)
    else:
        factor = 4 if scaling == "delayed" else 1
        sx, sw = (_scale_of(v, E4M3) / factor for v in (rows, wd))
        sg = _scale_of(grads, E5M2) / factor
        dx_steps = _step(grads, sg, E5M2), _step(wd, sw, E4M3)
        dw_steps = _step(grads, sg, E5M2).t(), _step(rows, sx, E4M3)
    y_rows = y.detach().reshape(20, 32)
    assert_within(y_rows, rows @ wd.t() + bd, _bound(rows, _step(rows, sx, E4M3), wd.t(), _step(wd, sw, E4M3).t(), 2),
                  f"{scaling} y")
    assert_within(x.grad.reshape(20, 48), grads @ wd, _bound(grads, dx_steps[0], wd, dx_steps[1], 1), f"{scaling} dx")
    assert_within(model.weight.grad, grads.t() @ rows, _bound(grads.t(), dw_steps[0], rows, dw_steps[1], 1),
                  f"{scaling} dw")
    torch.testing.assert_close(model.bias.grad.double(), grads.sum(0), rtol=BF16_ROUNDING, atol=1e-9)
    if scaling == "delayed":   # this call's amaxes were rolled in, newest first, before the preloaded ones
        for name, value in (("x", rows), ("w", wd), ("grad", grads)):
            amax = value.abs().max().item()
            assert getattr(histories, name)[:2].tolist() == [amax, 4 * amax], name


def test_rowwise_keeps_the_digits_of_rows_that_span_decades():
    x = torch.randn(64, 256, generator=_seeded(7)) * torch.logspace(-3, 3, 64).reshape(64, 1)

    def row_errors(dim):
        copy, inverse = quantize(x, E4M3, 0, dim)
        return ((copy.double() * inverse - x.double()).norm(dim=1) / x.double().norm(dim=1))

    tensorwise, rowwise = row_errors(None), row_errors(-1)
    # per tensor, the small rows fall below e4m3's subnormals (a row 1e-3 of the largest: all zero)
    assert tensorwise.mean() > 0.15 and tensorwise.max() == 1.0   # mean 0.197 here
    assert rowwise.max() < 0.04   # each row its own power of two: e4m3's 2**-4 roundoff, ~0.026 RMS
    # the converted linear: the same rows through fp8_scaled_linear, per tensor vs per row
    model = nn.Linear(256, 32, bias=False)
    reference = x.bfloat16().double() @ model.weight.detach().bfloat16().double().t()
    errors = {}
    for scaling in ("current", "rowwise"):
        gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16, fp8_scaling=scaling)
        with torch.no_grad():
            out = gm(x).double()
        errors[scaling] = ((out - reference).norm(dim=1) / reference.norm(dim=1)).max().item()
    assert errors["current"] > 0.5 and errors["rowwise"] < 0.1, errors


# -- the converted module: graph, explain, state, training ---------------------------------------------------------

def test_explain_shows_each_scaling_node_with_the_matmul_it_scales():
    _, gm, _ = _linear_model("delayed", fp8_history=8, fp8_amax_from="most_recent", fp8_margin=1)
    rows = {r["node"]: r for r in amp_compiler.explain(gm).rows}
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" and facts(n).get("op") in SCALING_OPS]
    assert names == [f"linear_{which}_{part}" for which in ("x", "w") for part in ("amax", "scale", "fp8")]
    assert rows["linear_x_amax"]["rule"] == "fp8 scaling of linear's x: max |x| per tensor, float32"
    assert rows["linear_w_scale"]["rule"] == (
        "fp8 scaling of linear's w: power of two from the most_recent of fp8_history.linear.w (8 calls' amax; "
        "this call's while empty; recorded in training mode) <= 448 (e4m3), / 2**1")
    assert rows["linear_x_fp8"]["rule"] == "fp8 scaling of linear's x: x * scale as float8_e4m3fn, saturating at +-448"
    assert facts(next(n for n in gm.graph.nodes if n.name == "linear_x_fp8"))["dtype"] == E4M3
    assert rows["linear"]["rule"].startswith("fp8 (e4m3 operands -> bfloat16 via _scaled_mm, e5m2 gradients; "
                                             "per-tensor delayed scaling (most_recent of 8 calls' amax)")
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    assert linear.target.__name__ == "fp8_scaled_linear" and linear.args[7:] == (
        E5M2, 1, False, next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "fp8_history.linear"),
        "most_recent")


def test_histories_save_and_resume_to_the_same_next_scale():
    model, gm, x = _linear_model("delayed", fp8_history=4)
    for step in range(3):
        gm(x * (step + 1)).sum().backward()   # amax grows: the max of the history lags this call's
    state = {k: v.clone() for k, v in gm.state_dict().items()}
    assert {"fp8_history.linear.x", "fp8_history.linear.w", "fp8_history.linear.grad"} <= set(state)
    assert state["fp8_history.linear.x"].tolist() == [(x * n).abs().max().item() for n in (3, 2, 1)] + [0.0]
    _, resumed, _ = _linear_model("delayed", fp8_history=4)
    _, fresh, _ = _linear_model("delayed", fp8_history=4)
    resumed.load_state_dict(state)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    small = x * 1e-3   # scaled from the history (3x amax), its values land among e4m3 subnormals; fresh: not
    outs = {name: m(small) for name, m in (("gm", gm), ("resumed", resumed), ("loaded", loaded), ("fresh", fresh))}
    assert torch.equal(outs["resumed"], outs["gm"]) and torch.equal(outs["loaded"], outs["gm"])
    assert not torch.equal(outs["fresh"], outs["gm"])
    assert torch.equal(resumed.fp8_history.linear.x, gm.fp8_history.linear.x)


def test_a_validation_pass_in_eval_mode_leaves_the_histories():
    _, gm, x = _linear_model("delayed")
    gm(x).sum().backward()
    before = {k: v.clone() for k, v in gm.state_dict().items() if "fp8_history" in k}
    gm.eval()
    with torch.no_grad():
        gm(x * 100)
    gm(x * 100).sum().backward()   # eval with a backward: the gradient's history stays too
    assert all(torch.equal(gm.state_dict()[k], v) for k, v in before.items())
    gm.train()
    gm(x * 100)
    assert gm.fp8_history.linear.x[0].item() == (x * 100).bfloat16().abs().max().item()




@pytest.mark.parametrize("inplace", [False, True])
def test_a_graph_captured_in_eval_mode_does_not_record(inplace):
    """The histories are added after the graph module took the model's flag: they must take it too. In place,
    model.eval() captures its own graph (and history): its calls recorded every validation batch's amax and the
    next eval call scaled from the largest of them (500 -> a 2**-1 scale for inputs of amax 77)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32)).eval()
    converted = amp_compiler.convert(model, "fp8", fp8_min_dim=16, fp8_scaling="delayed", inplace=inplace,
                                     **({} if inplace else {"example_inputs": (torch.randn(4, 32),)}))
    x = torch.ones(4, 32)
    x[0, 0] = 500.0
    with torch.no_grad():
        converted(x)
    from amp_compiler.dynamo import graphs
    gms = graphs(model) if inplace else [converted]   # in place: on dynamo, whose graphs take the model's flag
    assert len(gms) == 1 and inplace or [gm.training for gm in gms] == [False]
    (history,) = gms[0].fp8_history.children()   # the one Linear's
    assert not history.training and not history.x.any()

@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_neither_records_twice_nor_changes_the_gradients(use_reentrant):
    """torch.utils.checkpoint re-runs the forward inside the backward: that run must not record the amaxes again
    (the window would hold each call twice) and must take the first run's scale (with the call's amax already
    recorded, a history's max differs: weight gradients were 0.35-0.66 relative apart for inputs growing 4x)."""
    histories, grads = {}, {}
    for checkpointed in (False, True):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        gm = amp_compiler.convert(model, "fp8", example_inputs=(torch.randn(4, 32),), fp8_min_dim=16,
                                  fp8_scaling="delayed", fp8_history=8).train()
        for step in range(3):
            x = (torch.randn(16, 32, generator=_seeded(20 + step)) * 4 ** step).requires_grad_()   # reentrant: needed
            model.zero_grad()
            y = torch.utils.checkpoint.checkpoint(gm, x, use_reentrant=use_reentrant) if checkpointed else gm(x)
            y.float().square().sum().backward()
        losses = []   # then 10 micro-batches (more than the history holds) accumulated before one backward
        for micro in range(10):
            x = (torch.randn(8, 32, generator=_seeded(30 + micro)) * 2.0 ** -micro).requires_grad_()
            y = torch.utils.checkpoint.checkpoint(gm, x, use_reentrant=use_reentrant) if checkpointed else gm(x)
            losses.append(y.float().square().sum())
        if checkpointed:
            assert gm.fp8_history.linear.x[:3].tolist() == \
                [(torch.randn(8, 32, generator=_seeded(30 + micro)) * 2.0 ** -micro).bfloat16().abs().max().item()
                 for micro in (9, 8, 7)]
        sum(losses).backward()
        histories[checkpointed] = {k: v.clone() for k, v in gm.state_dict().items() if "fp8_history" in k}
        grads[checkpointed] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(histories[True][k], v) for k, v in histories[False].items())
    # reentrant: each micro-batch's backward adds to .grad on its own (fp32 summation order: 4e-8 measured)
    assert all(torch.equal(a, b) if not use_reentrant else (a - b).norm() <= 1e-6 * b.norm()
               for a, b in zip(grads[True], grads[False]))


def test_build_train_network_records_histories_through_the_joint_graph():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = amp_compiler.build_train_network(model, optimizer, nn.MSELoss(), level="fp8", dtype=torch.bfloat16,
                                            example_inputs=(torch.randn(4, 32),), fp8_min_dim=16,
                                            fp8_scaling="delayed", fp8_history=4)
    inputs = [torch.randn(4, 32, generator=_seeded(9 + i)) * (i + 1) for i in range(3)]
    for x in inputs:
        step(x, torch.randn(4, 16))
    histories = step.converted.fp8_history
    assert histories.linear.x[:3].tolist() == [x.bfloat16().abs().max().item() for x in reversed(inputs)]
    assert (histories.linear_1.grad[:3] > 0).all() and histories.linear.w[3].item() == 0
    assert not any(is_fake(amax) for which in ("x", "w") for amax, _ in histories.linear.issued(which))   # tracing
    restored = step.graph_module.meta["amp_step"]["restored_on_overflow"]   # a skipped step gives them back
    assert {f"fp8_history.linear{i}.{h}" for i in ("", "_1") for h in ("x", "w", "grad")} <= set(restored)


def test_the_users_model_gets_no_histories():
    model = nn.Sequential(nn.Linear(32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = amp_compiler.convert(model, "fp8", example_inputs=(torch.randn(2, 32),), fp8_min_dim=16,
                              fp8_scaling="delayed")
    gm(torch.randn(2, 32)).sum().backward()
    assert set(model.state_dict()) == set(before) and all(torch.equal(model.state_dict()[k], v)
                                                          for k, v in before.items())
    assert [name for name, _ in model.named_modules()] == ["", "0"] and "fp8_history.linear.x" in gm.state_dict()


# -- addmm, phase 1's names, calibration's figures ------------------------------------------------------------------

class AddMM(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 16) * 0.1)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def test_addmm_is_lowered_as_a_matmul_with_its_bias():
    model, x = AddMM(), torch.randn(24, 32, generator=_seeded(10))
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16)
    node = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "fp8_scaled_matmul")
    assert facts(node)["rule"].startswith("fp8 (")
    gm(x).sum().backward()
    reference = (x.bfloat16().double() @ model.weight.detach().bfloat16().double()) + model.bias.detach().double()
    fp8_grad = model.bias.grad.clone()
    torch.testing.assert_close(fp8_grad, torch.full((16,), 24.0))   # the bias gradient: sum over rows of ones
    with torch.no_grad():
        error = ((gm(x).double() - reference).norm() / reference.norm()).item()
    assert 2 * BF16_ROUNDING < error < 0.06, error



def test_addmm_with_beta_or_alpha_stays_bf16_and_explain_says_why():
    class Scaled(AddMM):
        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight, beta=0.5)

    gm = amp_compiler.convert(Scaled(), "fp8", example_inputs=(torch.randn(8, 32),), fp8_min_dim=16)
    node = next(n for n in gm.graph.nodes if n.name == "addmm")
    assert facts(node)["rule"].endswith("fp8: kept bfloat16: addmm with beta=0.5: only beta = alpha = 1 is lowered "
                                        "to fp8")

def test_phase_one_graphs_still_run_and_load():
    model, x = nn.Sequential(nn.Linear(32, 32)), torch.randn(4, 32)
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16)
    graph = gm.graph
    linear = next(n for n in graph.nodes if n.name == "linear")
    linear.target, linear.args = fp8_linear, (linear.args[0], linear.args[1], linear.args[6], 0)   # phase 1's node
    graph.eliminate_dead_code()
    gm.recompile()
    assert "fp8_amax" not in gm.code and "fp8_linear(" in gm.code
    expected = gm(x)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), expected)
    with torch.no_grad():
        assert torch.equal(expected, amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16)(x))


def _o1_graph(model, x):
    """The graph lower_fp8_matmuls receives at the fp8 level: bf16 O1's (test_fp8.py checks they are the same)."""
    return amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))


def _calibration(x_error, w_error, x_rowwise, w_rowwise, x_amax=12.0, w_amax=0.25):
    return {"samples": 4, "x_amax": x_amax, "w_amax": w_amax, "x_error": x_error, "w_error": w_error,
            "x_error_rowwise": x_rowwise, "w_error_rowwise": w_rowwise}


@pytest.mark.parametrize("scaling", ["current", "rowwise"])
def test_calibrated_error_above_fp8_max_error_keeps_bf16(scaling):
    model, x = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(4, 32)
    gm = _o1_graph(model, x)
    first, second = (n for n in gm.graph.nodes if facts(n).get("op") == "linear")
    facts(first)["fp8_calibration"] = _calibration(0.24, 0.02, 0.026, 0.02)    # outlier rows: per-tensor too coarse
    facts(second)["fp8_calibration"] = _calibration(0.03, 0.02, 0.02, 0.15)   # the weight's rows: bad either way
    options = Fp8Options(min_dim=16, scaling=scaling)
    result = lower_fp8_matmuls(gm, options, torch.bfloat16)
    rules = {n.name: facts(n)["rule"] for n in (first, second)}
    if scaling == "current":
        assert "fp8: kept bfloat16: calibrated e4m3 error x 0.24, w 0.02 (per tensor, 4 samples) > fp8_max_error " \
               "0.1" in rules[first.name]
        assert "calibrated e4m3 error x 0.03, w 0.02 (per tensor, 4 samples) <= 0.1" in rules[second.name]
        assert result.counts == {"fp8": 1, "kept": 1}
    else:
        assert "calibrated e4m3 error x 0.026, w 0.02 (per row, 4 samples) <= 0.1" in rules[first.name]
        assert "kept bfloat16: calibrated e4m3 error x 0.02, w 0.15 (per row" in rules[second.name]
        assert result.counts == {"fp8": 1, "kept": 1}


def test_delayed_histories_start_from_the_calibrated_amax():
    model, x = nn.Sequential(nn.Linear(32, 32)), torch.randn(4, 32)
    gm = _o1_graph(model, x)
    linear = next(n for n in gm.graph.nodes if facts(n).get("op") == "linear")
    facts(linear)["fp8_calibration"] = _calibration(0.03, 0.02, 0.02, 0.02, x_amax=12.0, w_amax=0.25)
    lower_fp8_matmuls(gm, Fp8Options(min_dim=16, scaling="delayed", history=3), torch.bfloat16)
    gm.recompile()
    histories = gm.fp8_history.linear
    assert histories.x.tolist() == [12.0, 0, 0] and histories.w.tolist() == [0.25, 0, 0]
    assert histories.grad.tolist() == [0, 0, 0]
    scale_node = next(n for n in gm.graph.nodes if n.name == "linear_x_scale")
    scale = scale_node.target(torch.tensor(1.0), histories.eval(), "x", E4M3, 0, "max")
    assert scale.item() == reference_scale(12.0, E4M3)   # the calibrated amax, not this call's 1.0


class MatmulThenLinear(nn.Module):
    """x @ b with b (K, N), and F.linear with b^T: the same product, lowered as fp8_scaled_matmul / _linear."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(48, 32, generator=_seeded(11)) * torch.logspace(-2, 2, 32))

    def forward(self, x):
        return torch.matmul(x, self.b), nn.functional.linear(x, self.b.t())


@pytest.mark.parametrize("scaling", ["current", "rowwise"])
def test_a_matmuls_operand_is_scaled_as_the_linears_transposed_weight(scaling):
    # row-wise, a (K, N) operand is scaled per column (fp8_amax(b, 0)): per row of the linear's (N, K) weight.
    # Its columns span 4 decades here, so scaling it per row of (K, N) instead would change the numbers.
    model, x = MatmulThenLinear(), torch.randn(2, 8, 48, generator=_seeded(12))
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16, fp8_scaling=scaling)
    targets = sorted(getattr(n.target, "__name__", "") for n in gm.graph.nodes if "scaled" in str(n.target))
    assert targets == ["fp8_scaled_linear", "fp8_scaled_matmul"]
    grads = []
    for which in (0, 1):
        model.b.grad = None
        leaf = x.clone().requires_grad_()
        out = gm(leaf)[which]
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        grads.append((out.detach(), leaf.grad, model.b.grad.clone()))
    for matmul_value, linear_value in zip(*grads):
        assert torch.equal(matmul_value, linear_value)


class ExportOnly(nn.Module):
    """`if x.shape[0] > 2` defeats fx symbolic trace: torch.export captures it, as it does Hugging Face models
    called with labels; its matmuls are ATen overloads (aten.linear / matmul / addmm), not torch functions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.proj = nn.Parameter(torch.randn(32, 16) / 6)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        if x.shape[0] > 2:
            x = x * 2
        h = torch.relu(self.fc(x))
        return torch.addmm(self.bias, h, self.proj) + h @ self.proj


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_torch_export_capture_lowers_its_aten_matmuls(scaling):
    x = torch.randn(8, 32)
    model = ExportOnly()
    gm = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16, fp8_scaling=scaling)
    assert gm.meta["amp"]["frontend"] == "torch.export"
    assert gm.meta["amp"]["pass_counts"]["lower_fp8_matmuls"]["fp8"] == 3, amp_compiler.explain(gm)   # linear, addmm, matmul
    reference = model(x)
    error = (gm(x).float() - reference).norm() / reference.norm()
    assert 5e-3 < error < 0.1   # fp8 ran (bf16 alone: ~3e-3) and is right to fp8's error
