"""GradScaler parity: PyTorch's own GradScaler test cases (test/test_torch.py and test/test_cuda.py: scale,
state_dict, autocast with pickling, clipping, unscale_ before clipping, gradient penalty, accumulation,
two optimizers, sparse gradients, misuse), ported and run against torch.amp.GradScaler itself (so each
ported case is known to be right), amp_compiler.GradScaler, DynamicLossScaleManager and
FixedLossScaleManager. Each case trains a scaled model and an unscaled control side by side, one step
poisoned with inf, and compares parameters and the final scale."""
import pickle
from itertools import chain

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import DynamicLossScaleManager, FixedLossScaleManager

INIT_SCALE = 128.0
POISONED_ITERATION = 2


def torch_scaler(init_scale=INIT_SCALE, growth_factor=2.0, growth_interval=1, enabled=True):
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                growth_interval=growth_interval, enabled=enabled)


def our_grad_scaler(init_scale=INIT_SCALE, growth_factor=2.0, growth_interval=1, enabled=True):
    return amp_compiler.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                   growth_interval=growth_interval, enabled=enabled)


def dynamic_manager(init_scale=INIT_SCALE, growth_factor=2.0, growth_interval=1, enabled=True):
    return DynamicLossScaleManager(init_scale, growth_factor, growth_interval, enabled=enabled)


def fixed_manager(init_scale=INIT_SCALE, growth_factor=None, growth_interval=None, enabled=True):
    return FixedLossScaleManager(init_scale, enabled=enabled)


SCALERS = {"torch GradScaler": torch_scaler, "amp_compiler.GradScaler": our_grad_scaler,
           "DynamicLossScaleManager": dynamic_manager, "FixedLossScaleManager": fixed_manager}
GROWING = {name: SCALERS[name] for name in SCALERS if name != "FixedLossScaleManager"}


def expected_scale(scaler, grown, backed_off):
    """The scale after `grown` growths and `backed_off` back-offs (a fixed scale never moves)."""
    if not scaler.is_enabled():
        return 1.0
    if isinstance(scaler, FixedLossScaleManager):
        return INIT_SCALE
    return INIT_SCALE * scaler.get_growth_factor() ** grown * scaler.get_backoff_factor() ** backed_off


def twin_models(seed):
    """Two identical 2-layer models with an optimizer each: one trains scaled, the other is the control."""
    torch.manual_seed(seed)
    control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaled = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaled.load_state_dict(control.state_dict())
    return control, scaled


def scaling_case(seed=0, optimizer=torch.optim.SGD, **optimizer_kwargs):
    control, scaled = twin_models(seed)
    kwargs = {"lr": 1.0, **optimizer_kwargs}
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return control, scaled, optimizer(control.parameters(), **kwargs), optimizer(scaled.parameters(), **kwargs), data


def compare_scaled_with_control(make_scaler, train, grown, backed_off, atol=1e-7, **case_kwargs):
    """Port of _run_scaling_case: enabled and disabled scalers must not change the user's control flow."""
    for enabled in (True, False):
        control, scaled, control_optimizer, scaled_optimizer, data = scaling_case(**case_kwargs)
        scaler = make_scaler(enabled=enabled)
        train(data, control, control_optimizer, scaler, use_scaler=False)
        scaler = train(data, scaled, scaled_optimizer, scaler, use_scaler=True) or scaler
        assert scaler.get_scale() == expected_scale(scaler, grown, backed_off)
        for c, s in zip(control.parameters(), scaled.parameters()):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=atol)


def step_unless_poisoned(optimizer, scaler, iteration):
    """The control's half of a case: skip the poisoned iteration exactly when the scaler would."""
    if not scaler.is_enabled() or iteration != POISONED_ITERATION:
        optimizer.step()


def poison_if_due(model, scaler, iteration):
    if iteration == POISONED_ITERATION and scaler.is_enabled():
        model[1].weight.grad.fill_(float("inf"))


def backward_and_step(loss, model, optimizer, scaler, iteration, use_scaler):
    """The usual end of an iteration: the control's backward and step, or the scaler's four calls with
    the poisoned iteration's gradient set to inf."""
    if not use_scaler:
        loss.backward()
        step_unless_poisoned(optimizer, scaler, iteration)
        return
    scaler.scale(loss).backward()
    poison_if_due(model, scaler, iteration)
    scaler.step(optimizer)
    scaler.update()


# --- the cases -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_scale_of_nested_lists_and_tuples(make_scaler):
    scaler = make_scaler(init_scale=2.0)
    four = torch.full((1,), 4.0)
    outputs = scaler.scale((four.clone(), (four.clone(), four.clone()), [four.clone(), (four.clone(), four)]))
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert [float(t) for t in flat] == [8.0] * 6
    assert isinstance(outputs[2], list) and isinstance(outputs[2][1], tuple)


@pytest.mark.parametrize("make_scaler", [our_grad_scaler, dynamic_manager, fixed_manager])
def test_scale_of_a_dict_and_a_bf16_loss(make_scaler):
    """Beyond GradScaler (whose scale() turns a dict into its keys): dict values are scaled, in fp32."""
    scaler = make_scaler(init_scale=2.0)
    scaled = scaler.scale({"main": torch.tensor(3.0), "aux": [torch.tensor(1.0, dtype=torch.bfloat16)]})
    assert float(scaled["main"]) == 6.0 and scaled["aux"][0].dtype == torch.float32
    with pytest.raises(TypeError, match="tensor or a list/tuple/dict"):
        scaler.scale(3.0)


@pytest.mark.parametrize("make_scaler", GROWING.values(), ids=GROWING)
def test_state_dict_round_trip(make_scaler):
    for scale_first in (True, False):
        saved = make_scaler(init_scale=3.0, growth_factor=4.0, growth_interval=2)
        saved.set_backoff_factor(0.5)
        loader = make_scaler(init_scale=6.0, growth_factor=7.0, growth_interval=1)
        loader.set_backoff_factor(0.8)
        if scale_first:
            loader.scale(torch.full((1,), 4.0))
        loader.load_state_dict(saved.state_dict())
        assert loader.get_scale() == 3.0 and loader.get_growth_factor() == 4.0
        assert loader.get_backoff_factor() == 0.5 and loader.get_growth_interval() == 2


def iterate(scaler, model, optimizer, overflow):
    """One plain-loop iteration; `overflow` poisons a gradient."""
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("make_scaler", [our_grad_scaler, dynamic_manager])
def test_a_torch_grad_scaler_checkpoint_loads_and_continues_identically(make_scaler):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    theirs, ours = torch_scaler(growth_interval=3), make_scaler(init_scale=1.0, growth_interval=50)
    for overflow in (False, True, False):
        iterate(theirs, model, optimizer, overflow)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale() == 64.0 and ours.get_growth_interval() == 3
    for overflow in (False, False, False, True, False):     # 1 clean step was carried over: grows after 2
        iterate(theirs, model, optimizer, overflow)
        iterate(ours, model, optimizer, overflow)
        assert ours.get_scale() == theirs.get_scale()


@pytest.mark.parametrize("pickled", [False, True], ids=["plain", "pickled every step"])
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_autocast_bf16_with_scaling_matches_fp32(make_scaler, pickled):
    def train(data, model, optimizer, scaler, use_scaler):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_scaler):
                loss = nn.functional.mse_loss(model(x), y)
            backward_and_step(loss, model, optimizer, scaler, i, use_scaler)
            if pickled:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    compare_scaled_with_control(make_scaler, train, grown=3, backed_off=1, atol=2e-2)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["clip scaled gradients", "unscale_ then clip"])
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_clipping(make_scaler, unscale_first):
    max_norm = 0.2

    def train(data, model, optimizer, scaler, use_scaler):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if not use_scaler:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                step_unless_poisoned(optimizer, scaler, i)
                continue
            scaler.scale(loss).backward()
            if unscale_first:
                poison_if_due(model, scaler, i)
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:   # clip the scaled gradients against a scaled norm, poison after clipping
                nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                poison_if_due(model, scaler, i)
            scaler.step(optimizer)
            scaler.update()

    compare_scaled_with_control(make_scaler, train, grown=3, backed_off=1, atol=1e-5)


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_gradient_penalty(make_scaler):
    def train(data, model, optimizer, scaler, use_scaler):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if use_scaler:
                scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                grads = [g * (1.0 / scaler.get_scale()) for g in scaled_grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            backward_and_step(loss, model, optimizer, scaler, i, use_scaler)

    compare_scaled_with_control(make_scaler, train, grown=3, backed_off=1)


@pytest.mark.parametrize("optimizer", [dict(optimizer=torch.optim.SGD),
                                       dict(optimizer=torch.optim.Adam, lr=1e-2, fused=True)], ids=["SGD", "fused Adam"])
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_gradient_accumulation_over_micro_batches(make_scaler, optimizer):
    micro_batches = 2

    def train(data, model, optimizer, scaler, use_scaler):
        for i, (x, y) in enumerate(data):
            loss = nn.functional.mse_loss(model(x), y) / micro_batches
            (scaler.scale(loss) if use_scaler else loss).backward()
            if (i + 1) % micro_batches:
                continue
            if use_scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()

    compare_scaled_with_control(make_scaler, train, grown=2, backed_off=0, atol=1e-6, **optimizer)


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_two_models_two_optimizers_two_losses(make_scaler):
    for enabled in (True, False):
        control0, scaled0, control_opt0, scaled_opt0, data = scaling_case(seed=0)
        control1, scaled1 = twin_models(seed=1)
        control_opt1 = torch.optim.SGD(control1.parameters(), lr=1.0)
        scaled_opt1 = torch.optim.SGD(scaled1.parameters(), lr=1.0)
        scaler = make_scaler(enabled=enabled)

        def train(model0, model1, optimizer0, optimizer1, use_scaler):
            for i, (x, y) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                out0, out1 = model0(x), model1(x)
                loss0 = nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
                loss1 = nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
                if not use_scaler:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()                  # only model1's gradient is poisoned
                    step_unless_poisoned(optimizer1, scaler, i)
                    continue
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                poison_if_due(model1, scaler, i)
                scaler.unscale_(optimizer0)        # one optimizer unscaled separately, as in torch's test
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()

        train(control0, control1, control_opt0, control_opt1, use_scaler=False)
        train(scaled0, scaled1, scaled_opt0, scaled_opt1, use_scaler=True)
        assert scaler.get_scale() == expected_scale(scaler, grown=3, backed_off=1)
        for c, s in zip(chain(control0.parameters(), control1.parameters()),
                        chain(scaled0.parameters(), scaled1.parameters())):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_unscale_divides_in_place_and_an_inf_anywhere_skips_the_step(make_scaler):
    scaler = make_scaler(init_scale=4.0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(torch.tensor(1.0))                       # torch's scaler creates its scale lazily here
    model.weight.grad = torch.full_like(model.weight, 8.0)
    model.bias.grad = torch.tensor([8.0, float("nan")])
    scaler.unscale_(optimizer)
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 2.0))
    assert scaler.step(optimizer) is None                 # skipped: the parameters did not move
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_sparse_gradients_are_unscaled_and_checked(make_scaler):
    scaler = make_scaler(init_scale=2.0)
    embedding = nn.Embedding(5, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=1.0)
    scaler.scale(embedding(torch.tensor([1, 1, 3])).sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(embedding.weight.grad.to_dense().sum(1), torch.tensor([0.0, 6.0, 0.0, 3.0, 0.0]))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    before = embedding.weight.detach().clone()
    scaler.scale(torch.zeros(()))                         # this iteration's scale(); its gradient is planted
    embedding.weight.grad = torch.sparse_coo_tensor([[2]], [[float("inf"), 0.0, 0.0]], (5, 3),
                                                    check_invariants=True)
    assert scaler.step(optimizer) is None and torch.equal(embedding.weight, before)


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_misuse_raises_as_gradscaler_does(make_scaler):
    scaler = make_scaler()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) (has already been|was already) called on this optimizer "
                                           r"since the last update\(\)"):
        scaler.unscale_(optimizer)                        # twice in one iteration
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)                        # after step()
    with pytest.raises(RuntimeError, match=r"step\(\) (has already been|was already) called .*since the last update\(\)"):
        scaler.step(optimizer)                            # twice in one iteration
    scaler.update()
    with pytest.raises(RuntimeError, match="[Cc]losure"):
        scaler.step(optimizer, closure=lambda: 0.0)


@pytest.mark.parametrize("method", ["step", "unscale_"])
@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_step_or_unscale_before_any_scale_raises_as_gradscaler_does(make_scaler, method):
    """torch's _check_scale_growth_tracker: 'did not use scaler.scale(loss or outputs) earlier'."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(1, 2)).sum().backward()              # the unscaled backward of a forgotten scale()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((AssertionError, RuntimeError), match=r"scale\(\)|scaler\.scale"):
        getattr(make_scaler(), method)(optimizer)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("method", ["step", "unscale_"])
@pytest.mark.parametrize("make_scaler", [our_grad_scaler, dynamic_manager, fixed_manager])
def test_step_without_scale_in_a_later_iteration_raises(make_scaler, method):
    """Beyond GradScaler, which accepts this once scale() ran in any earlier iteration and steps by
    gradient / scale (an update INIT_SCALE times too small): no scale() since the last update() raises."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = make_scaler()
    iterate(scaler, model, optimizer, overflow=False)
    optimizer.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"{method}\(\) was called with no scale\(\) since the last update"):
        getattr(scaler, method)(optimizer)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), gradients))  # not divided
    scaler.scale(torch.tensor(0.0))                        # scaling in the iteration makes it legal again
    getattr(scaler, method)(optimizer)


@pytest.mark.parametrize("make_scaler", [our_grad_scaler, dynamic_manager])
def test_gradients_scaled_before_load_state_dict_are_not_unscaled_with_the_loaded_scale(make_scaler):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = make_scaler()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.load_state_dict(make_scaler(init_scale=4.0).state_dict())
    with pytest.raises(RuntimeError, match="no scale"):
        scaler.step(optimizer)


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_update_with_a_new_scale(make_scaler):
    scaler = make_scaler()
    scaler.scale(torch.tensor(1.0))
    scaler.update(new_scale=512.0)
    assert scaler.get_scale() == 512.0
    scaler.update(new_scale=torch.tensor(64.0))
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS)
def test_disabled_scaler_passes_everything_through(make_scaler):
    scaler = make_scaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    scaler.step(optimizer)                                # no check when disabled: the step is applied
    scaler.update()
    assert not torch.isfinite(model.weight).all()
