"""One non-finite policy (issue 10): every step checks its gradients; a non-finite step is skipped at every
level, with or without a manager, unless the manager says drop_overflow_update=False; the returned flag
says which; a run of such steps warns once and raises past bad_step_max, whichever manager (or none)."""
import warnings

import pytest
import torch
from torch import nn

from amp_compiler import (DynamicLossScaleManager, FixedLossScaleManager, NonFiniteGradientsError, Overflow,
                          build_train_network)
from amp_compiler.train.bad_steps import BAD_STEP_MAX
from amp_testing import one_torch_thread


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batch(poison=None):
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    if poison is not None:
        x[0, 0] = poison
    return x, y


def state_of(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


NAN, INF = float("nan"), float("inf")
CONFIGS = {   # (level, dtype, manager factory or None for the level's default, poison)
    "O0 no manager": ("O0", torch.float16, None, NAN),
    "O1 bf16 no manager": ("O1", torch.bfloat16, None, INF),
    "O1 fp16 no manager": ("O1", torch.float16, None, NAN),
    "O3 fp16 no manager": ("O3", torch.float16, None, INF),
    "O2 fp16 default (dynamic)": ("O2", torch.float16, None, NAN),
    "O2 bf16 default (scale 1)": ("O2", torch.bfloat16, None, INF),
    "O1 fixed 128": ("O1", torch.float16, lambda: FixedLossScaleManager(128.0), NAN),
    "O2 dynamic 2**8": ("O2", torch.float16, lambda: DynamicLossScaleManager(2 ** 8), INF),
}


@pytest.fixture
def one_thread():
    """Tiny tensors: the intra-op thread pool costs more than it saves (5 ms a step against 0.4 ms)."""
    with one_torch_thread():
        yield


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_non_finite_step_is_skipped_at_every_level_and_the_flag_says_so(config, one_thread):
    level, dtype, factory, poison = CONFIGS[config]
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level=level, dtype=dtype,
                               loss_scale_manager=factory() if factory else None)
    assert step(*batch())[1] is Overflow.NONE
    before = state_of(model)
    _, overflow, _ = step(*batch(poison))
    assert overflow is Overflow.SKIPPED and str(overflow) == "skipped"
    after = state_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the model"
    assert "2 steps: 1 applied, 1 skipped" in step.report()


def test_drop_overflow_update_false_applies_the_step_and_the_flag_says_applied():
    model = tiny_model()
    manager = FixedLossScaleManager(1.0, drop_overflow_update=False)
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O1", dtype=torch.bfloat16, loss_scale_manager=manager)
    _, overflow, _ = step(*batch(float("nan")))
    assert overflow is Overflow.APPLIED and overflow      # truthy: the gradients were non-finite
    assert not torch.isfinite(model[0].weight).all()
    assert "1 applied despite inf/nan gradients" in step.report()


@pytest.mark.slow
def test_no_manager_raises_after_bad_step_max_consecutive_skips_with_one_warning(one_thread):
    """The issue's O1 case: NaN on every step used to poison the parameters while reporting overflow."""
    model = tiny_model()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O1", dtype=torch.bfloat16)
    poisoned = batch(float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(BAD_STEP_MAX):
            assert step(*poisoned)[1] is Overflow.SKIPPED
        with pytest.raises(NonFiniteGradientsError, match=r"1001 consecutive training steps .* were skipped"):
            step(*poisoned)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith("50 consecutive training steps"), messages
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.slow
@pytest.mark.parametrize("make_manager", [
    lambda: FixedLossScaleManager(1.0, bad_step_max=6),
    lambda: FixedLossScaleManager(1.0, drop_overflow_update=False, bad_step_max=6),
    lambda: DynamicLossScaleManager(2 ** 4, bad_step_max=6),
], ids=["fixed", "fixed applying", "dynamic"])
def test_every_manager_raises_past_its_bad_step_max_and_says_what_to_check(make_manager):
    model = tiny_model()
    manager = make_manager()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O2", dtype=torch.float16, loss_scale_manager=manager)
    with pytest.warns(RuntimeWarning, match="3 consecutive training steps"):
        for _ in range(6):
            step(*batch(float("inf")))
    with pytest.raises(NonFiniteGradientsError, match="7 consecutive .* bad_step_max=6.* check the inputs"):
        step(*batch(float("inf")))


@pytest.mark.slow
def test_a_clean_step_ends_the_run_and_rearms_the_warning():
    model = tiny_model()
    manager = FixedLossScaleManager(1.0, bad_step_max=8)
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O1", dtype=torch.bfloat16, loss_scale_manager=manager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for _ in range(8):                      # 8 in a row: at the limit, not past it
                step(*batch(float("nan")))
            assert manager.bad_steps.consecutive == 8
            step(*batch())
            assert manager.bad_steps.consecutive == 0
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 2


class SeedsOnlyManager:
    """A custom manager with only the seeds' three methods: the step counts its bad steps itself."""
    bad_step_max = 4

    def get_loss_scale(self):
        return 1.0

    def update_loss_scale(self, overflow):
        pass

    def get_drop_overflow_update(self):
        return True


@pytest.mark.slow
def test_a_custom_manager_is_held_to_the_same_limit():
    model = tiny_model()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O1", dtype=torch.bfloat16, loss_scale_manager=SeedsOnlyManager())
    with pytest.warns(RuntimeWarning):
        for _ in range(4):
            assert step(*batch(float("nan")))[1] is Overflow.SKIPPED
    with pytest.raises(NonFiniteGradientsError, match="5 consecutive"):
        step(*batch(float("nan")))


def test_the_plain_loop_is_held_to_the_same_limit():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = DynamicLossScaleManager(2 ** 8, bad_step_max=2)
    with pytest.raises(NonFiniteGradientsError, match="3 consecutive"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            optimizer.zero_grad()
            manager.scale(nn.functional.cross_entropy(model(batch(float("nan"))[0]), batch()[1])).backward()
            assert manager.step(optimizer) is None
            manager.update()


def test_bad_step_max_is_checked_and_none_disables_the_error():
    with pytest.raises(ValueError, match="bad_step_max must be a positive number"):
        FixedLossScaleManager(bad_step_max=0)
    manager = FixedLossScaleManager(1.0, bad_step_max=None)
    with pytest.warns(RuntimeWarning, match="nothing stops it"):
        for _ in range(BAD_STEP_MAX + 5):
            manager.update_loss_scale(True)
