"""Loss-scale managers: the seeds' update rule, their errors, and the GradScaler-style plain-loop API."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from amp_compiler.train.bad_steps import BAD_STEP_MAX, NonFiniteGradientsError
from amp_compiler.train.loss_scale import (TRAIN_STEP_INIT_SCALE, DynamicLossScaleManager, FixedLossScaleManager,
                                     default_loss_scale_manager)


# --- the seeds' update rule --------------------------------------------------------------------------
def test_dynamic_defaults_are_the_seeds():
    manager = DynamicLossScaleManager()
    assert manager.get_loss_scale() == 2 ** 24
    assert (manager.scale_factor, manager.scale_window) == (2, 2000)
    assert manager.get_drop_overflow_update() is True


def test_dynamic_halves_on_overflow_and_never_goes_below_one():
    manager = DynamicLossScaleManager(init_loss_scale=4, scale_factor=2, scale_window=10)
    scales = []
    for _ in range(4):
        manager.update_loss_scale(True)
        scales.append(manager.get_loss_scale())
    assert scales == [2, 1, 1, 1]


def test_dynamic_grows_after_window_clean_steps_counted_from_the_last_overflow():
    manager = DynamicLossScaleManager(init_loss_scale=8, scale_factor=2, scale_window=3)
    manager.update_loss_scale(False)
    manager.update_loss_scale(False)
    manager.update_loss_scale(True)           # resets the count: 2 clean steps are forgotten
    assert manager.get_loss_scale() == 4
    scales = []
    for _ in range(6):
        manager.update_loss_scale(False)
        scales.append(manager.get_loss_scale())
    assert scales == [4, 4, 8, 8, 8, 16]


def test_more_than_1000_consecutive_overflows_raise():
    manager = DynamicLossScaleManager(init_loss_scale=1)
    with pytest.warns(RuntimeWarning, match="50 consecutive training steps"):
        for _ in range(BAD_STEP_MAX):
            manager.update_loss_scale(True)
    with pytest.raises(NonFiniteGradientsError, match="1001 consecutive training steps .* bad_step_max=1000"):
        manager.update_loss_scale(True)
    assert issubclass(NonFiniteGradientsError, RuntimeError)   # what the seeds raised


@pytest.mark.filterwarnings("ignore:.*consecutive training steps")
def test_a_clean_step_resets_the_consecutive_overflow_count():
    manager = DynamicLossScaleManager(init_loss_scale=1)
    for _ in range(BAD_STEP_MAX):
        manager.update_loss_scale(True)
    manager.update_loss_scale(False)
    for _ in range(BAD_STEP_MAX):
        manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 1 and manager.bad_steps.consecutive == BAD_STEP_MAX


@pytest.mark.parametrize("kwargs, message", [
    ({"init_loss_scale": 0.5}, "init_loss_scale must be a finite number >= 1"),
    ({"init_loss_scale": float("inf")}, "init_loss_scale must be a finite number >= 1"),
    ({"scale_factor": 1}, "scale_factor must be a finite number greater than 1"),
    ({"scale_factor": 0.5}, "scale_factor must be a finite number greater than 1"),
    ({"scale_window": 0}, "scale_window must be a positive integer"),
])
def test_dynamic_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaleManager(**kwargs)


def test_fixed_keeps_its_scale_and_reports_drop_flag():
    manager = FixedLossScaleManager(128.0, drop_overflow_update=False)
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 128.0
    assert manager.get_drop_overflow_update() is False
    assert FixedLossScaleManager().get_drop_overflow_update() is True
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= 1"):
        FixedLossScaleManager(0.9)


def test_level_defaults_scale_fp16_dynamically_and_bf16_with_scale_one():
    fp16 = default_loss_scale_manager("O2", torch.float16)
    assert isinstance(fp16, DynamicLossScaleManager) and fp16.get_loss_scale() == TRAIN_STEP_INIT_SCALE == 2 ** 16
    bf16 = default_loss_scale_manager("O2", torch.bfloat16)
    assert isinstance(bf16, FixedLossScaleManager)
    assert bf16.get_loss_scale() == 1 and bf16.get_drop_overflow_update()
    for level in ("O0", "O1", "O3"):
        assert default_loss_scale_manager(level, torch.float16) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5), st.sampled_from([2.0, 3.0, 1.5]))
def test_dynamic_rule_invariants(overflows, window, factor):
    manager = DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_factor=factor, scale_window=window)
    clean_run = 0
    for overflow in overflows:
        before = manager.get_loss_scale()
        manager.update_loss_scale(overflow)
        after = manager.get_loss_scale()
        clean_run = 0 if overflow else clean_run + 1
        if overflow:
            assert after == max(before * manager.get_backoff_factor(), 1.0)
            assert manager.get_backoff_factor() == pytest.approx(1 / factor)
        elif clean_run % window == 0:
            assert after == before * factor
        else:
            assert after == before
        assert after >= 1


# --- the plain-loop API ------------------------------------------------------------------------------
def tiny_regression(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(12)]
    return model, data


def plain_loop(scaler, model, data, poisoned_steps=()):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scales = []
    for index, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if index in poisoned_steps:
            model[0].weight.grad[0, 0] = float("nan") if index % 2 else float("inf")
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, optimizer


def test_plain_loop_matches_torch_grad_scaler_bit_for_bit():
    model, data = tiny_regression()
    reference_model = copy.deepcopy(model)
    ours, _ = plain_loop(DynamicLossScaleManager(2 ** 16, 2, 3), model, data, poisoned_steps=(2, 3, 7))
    theirs, _ = plain_loop(torch.amp.GradScaler("cpu", init_scale=2 ** 16, growth_interval=3), reference_model,
                           data, poisoned_steps=(2, 3, 7))
    assert ours == theirs
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)


def test_step_skips_on_inf_and_leaves_parameters_and_optimizer_state_untouched():
    model, data = tiny_regression()
    manager = DynamicLossScaleManager(2 ** 8, 2, 100)
    _, optimizer = plain_loop(manager, model, data[:2])
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    x, y = data[2]
    optimizer.zero_grad()
    manager.scale(nn.functional.mse_loss(model(x), y)).backward()
    model[2].bias.grad.fill_(float("inf"))
    assert manager.step(optimizer) is None
    manager.update()
    assert manager.last_overflow and manager.get_loss_scale() == 2 ** 7
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after = optimizer.state_dict()
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(after["state"][key][name], tensor)


def test_unscale_before_step_divides_once_and_allows_clipping():
    model, data = tiny_regression()
    x, y = data[0]
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    manager = FixedLossScaleManager(1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    manager.scale(nn.functional.mse_loss(model(x), y)).backward()
    manager.unscale_(optimizer)
    for p, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, grad, rtol=1e-6, atol=1e-8)
    with pytest.raises(RuntimeError, match="already called"):
        manager.unscale_(optimizer)
    manager.step(optimizer)  # must not unscale a second time
    for p, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, grad, rtol=1e-6, atol=1e-8)
    manager.update()


def test_fixed_without_drop_applies_the_overflowing_step():
    model, _ = tiny_regression()
    manager = FixedLossScaleManager(4.0, drop_overflow_update=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager.scale(torch.zeros(()))                  # the iteration's scale(); its gradients are planted
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[0].weight.grad[0, 0] = float("inf")
    manager.step(optimizer)
    manager.update()
    assert manager.last_overflow
    assert not torch.isfinite(model[0].weight).all()


def test_scale_keeps_an_fp16_loss_from_overflowing():
    scaled = DynamicLossScaleManager().scale(torch.tensor(100.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 100.0 * 2 ** 24


def test_plain_loop_misuse_is_explained():
    model, _ = tiny_regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = DynamicLossScaleManager()
    with pytest.raises(RuntimeError, match="no unscale_"):
        manager.update()
    with pytest.raises(TypeError, match="tensor or a list/tuple"):
        manager.scale(3.0)
    half = nn.Linear(2, 2).half()
    half.weight.grad = torch.ones_like(half.weight)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was called with no scale\(\) since the last update"):
        manager.unscale_(torch.optim.SGD(half.parameters(), lr=0.1))   # the TypeError above scaled nothing
    manager.scale(torch.zeros(()))
    with pytest.raises(ValueError, match="float16 gradients"):
        manager.unscale_(torch.optim.SGD(half.parameters(), lr=0.1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    manager.step(optimizer)
    with pytest.raises(RuntimeError, match="already called on this optimizer"):
        manager.step(optimizer)


def test_state_dict_resumes_identically():
    model, data = tiny_regression()
    manager = DynamicLossScaleManager(2 ** 10, 2, 4)
    plain_loop(manager, model, data[:6], poisoned_steps=(1,))
    saved = manager.state_dict()
    resumed = DynamicLossScaleManager()
    resumed.load_state_dict(saved)
    for overflow in [False, False, True, False, False, False, False, False]:
        manager.update_loss_scale(overflow)
        resumed.update_loss_scale(overflow)
        assert manager.get_loss_scale() == resumed.get_loss_scale()
    assert resumed.state_dict() == manager.state_dict()
    with pytest.raises(ValueError, match="from a 'DynamicLossScaleManager'"):
        FixedLossScaleManager().load_state_dict(saved)
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaleManager().load_state_dict({"type": "DynamicLossScaleManager", "loss_scale": 2.0})
