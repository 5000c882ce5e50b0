"""build_train_network: the joint graph's marked nodes, fp32 masters, overflow handling, underflow,
caching by shape and mode, bad input, and the zoo trained in mixed precision against fp32."""
import copy
import functools
import math

import pytest
import torch
import torch.fx as fx
from torch import nn

from amp_compiler import DynamicLossScaleManager, FixedLossScaleManager, Overflow, build_train_network
from amp_compiler.cli.demo import demo_training
from models import ZOO_NAMES, build

FP16_SMALLEST_SUBNORMAL = 2.0 ** -24


class TinyNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: every kind of state a step must handle."""

    def __init__(self, features=6, hidden=8, classes=3, dropout=0.25):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def tiny_task(seed=0, dropout=0.25):
    torch.manual_seed(seed)
    model = TinyNet(dropout=dropout)
    batches = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(8)]
    return model, batches


def snapshot(model, optimizer):
    """Every tensor a skipped step must leave alone: parameters, buffers, optimizer state."""
    tensors = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optimizer {index}.{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)})
    return tensors


def assert_bit_identical(before, after):
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"changed by a skipped step: {changed}"


# --- the joint graph ---------------------------------------------------------------------------------
def test_graph_module_shows_loss_scale_unscale_and_overflow_check_nodes():
    model, batches = tiny_task()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype=torch.bfloat16,
                               loss_scale_manager=DynamicLossScaleManager(2 ** 8))
    with pytest.raises(RuntimeError, match="no step has run yet"):
        step.graph_module
    step(*batches[0])
    gm = step.graph_module
    assert isinstance(gm, fx.GraphModule)
    gm.graph.lint()
    roles = {}
    for node in gm.graph.nodes:
        roles.setdefault(node.meta.get("amp_role"), []).append(node)
    scale_input = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "loss_scale")
    forward_product = [n for n in roles["loss_scale"] if n.args[1] is scale_input and n.args[0].op != "placeholder"]
    assert forward_product, "the loss is not multiplied by the scale in the graph"
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss, found_inf, *grads = output.args[0]
    assert len(grads) == len(list(model.parameters()))
    assert all(g.meta["amp_role"] == "unscale" for g in grads)
    assert found_inf.meta["amp_role"] == "overflow_check"
    # 1/scale, its 1-element view (low gradients times it come out fp32), then one product per gradient
    assert len(roles["unscale"]) == len(grads) + 2
    assert "loss_scale" in gm.code and "reciprocal" in gm.code


@pytest.mark.slow
def test_o0_step_matches_a_plain_fp32_loop_including_dropout_and_batchnorm():
    model, batches = tiny_task()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for index, (x, y) in enumerate(batches):
        torch.manual_seed(index)
        reference_optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        reference_optimizer.step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O0")
    for index, (x, y) in enumerate(batches):
        torch.manual_seed(index)
        _, overflow, scale = step(x, y)
        assert not overflow and scale == 1.0
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_master_weights_optimizer_state_and_gradients_stay_fp32_and_unscaled():
    model, batches = tiny_task(dropout=0.0)
    x, y = batches[0]
    nn.functional.cross_entropy(model(x), y).backward()
    fp32_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype=torch.float16,
                               loss_scale_manager=FixedLossScaleManager(1024.0))
    loss, overflow, scale = step(x, y)
    assert loss.dtype == torch.float32 and not overflow and scale == 1024.0
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32
        error = (p.grad - fp32_grads[name]).norm()  # fc1.bias feeds BatchNorm: its gradient is ~0
        assert error <= 2e-2 * fp32_grads[name].norm() + 1e-4, f"{name}: off by {error:.3g} (not unscaled?)"
    for state in optimizer.state.values():
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")


# --- underflow and overflow --------------------------------------------------------------------------
def tiny_gradient_loss(output, target):
    """A loss whose gradient w.r.t. the output is ~1e-9: below fp16's smallest subnormal (~6e-8)."""
    return 1e-9 * 0.5 * ((output - target) ** 2).sum()


def train_underflow_case(level, manager, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    initial = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=2e6)
    step = build_train_network(model, optimizer, tiny_gradient_loss, level=level, dtype=torch.float16,
                               loss_scale_manager=manager)
    for _ in range(steps):
        step(x, y)
    return model, initial, (x, y)


@pytest.mark.slow
def test_gradients_below_fp16_range_train_like_fp32_only_with_dynamic_scaling():
    fp32_model, initial, (x, y) = train_underflow_case("O0", None)
    output = initial(x).detach().requires_grad_()
    tiny_gradient_loss(output, y).backward()
    assert output.grad.abs().max() < FP16_SMALLEST_SUBNORMAL  # the case really underflows in fp16
    dynamic_model, _, _ = train_underflow_case("O2", DynamicLossScaleManager())
    fixed_model, _, _ = train_underflow_case("O2", FixedLossScaleManager(1.0))
    for p0, p32, pdyn, pfix in zip(initial.parameters(), fp32_model.parameters(), dynamic_model.parameters(),
                                   fixed_model.parameters()):
        assert (p32 - p0).abs().max() > 1e-2                  # fp32 training moves the weights
        torch.testing.assert_close(pdyn, p32, rtol=2e-2, atol=2e-3)
        assert torch.equal(pfix, p0)                          # every fp16 gradient flushed to zero


@pytest.mark.slow
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_injected_overflow_skips_the_step_and_leaves_everything_bit_identical(poison):
    model, batches = tiny_task()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_factor=2, scale_window=3)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype=torch.float16,
                               loss_scale_manager=manager)
    for x, y in batches[:2]:
        assert not step(x, y)[1]
    x, y = batches[2]
    poisoned = x.clone()
    poisoned[3, 1] = poison
    eager = copy.deepcopy(model)
    eager(poisoned)
    assert not torch.isfinite(eager.norm.running_mean).all()  # what PyTorch's own scaler leaves behind
    before = snapshot(model, optimizer)
    loss, overflow, scale = step(poisoned, y)
    assert overflow and scale == 2 ** 10 and manager.get_loss_scale() == 2 ** 9
    assert_bit_identical(before, snapshot(model, optimizer))
    scales = [step(x, y)[2] for x, y in batches[3:7]]
    assert scales == [2 ** 9, 2 ** 9, 2 ** 9, 2 ** 10]        # grows back after 3 clean steps
    assert not torch.equal(before["param fc1.weight"], model.fc1.weight)


def test_bf16_default_is_scale_one_with_non_finite_steps_skipped():
    model, batches = tiny_task()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype=torch.bfloat16)
    assert isinstance(step.loss_scale_manager, FixedLossScaleManager)
    x, y = batches[0]
    before = snapshot(model, optimizer)
    _, overflow, scale = step(torch.full_like(x, float("inf")), y)
    assert overflow and scale == 1.0
    assert_bit_identical(before, snapshot(model, optimizer))
    assert step(x, y)[1:] == (False, 1.0)


# --- caching, train/eval, dropout, frozen parameters ---------------------------------------------------
@pytest.mark.slow
def test_new_shapes_are_traced_once_and_reused():
    model, batches = tiny_task(dropout=0.0)
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                               level="O2", dtype=torch.bfloat16)
    x, y = batches[0]
    step(x, y)
    loss, _, _ = step(x[:5], y[:5])
    step(x, y)
    assert step.num_traces == 2
    expected = nn.functional.cross_entropy(step.converted(x[:5]).float(), y[:5])
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_eval_mode_of_the_model_is_followed():
    model, batches = tiny_task()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                               level="O2", dtype=torch.bfloat16)
    x, y = batches[0]
    first, second = step(x, y)[0], step(x, y)[0]
    assert not torch.equal(first, second)                   # fresh dropout masks every step
    model.eval()
    stats = model.norm.running_mean.clone()
    first, second = step(x, y)[0], step(x, y)[0]
    assert torch.equal(first, second) and torch.equal(stats, model.norm.running_mean)
    model.train()
    step(x, y)
    assert step.num_traces == 2
    assert not torch.equal(stats, model.norm.running_mean)


def test_same_seed_gives_same_dropout_masks():
    model, batches = tiny_task()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                               level="O2", dtype=torch.bfloat16)
    torch.manual_seed(3)
    first = step(*batches[0])[0]
    torch.manual_seed(3)
    assert torch.equal(first, step(*batches[0])[0])


def test_frozen_parameters_and_parameters_outside_the_optimizer_are_not_trained():
    model, batches = tiny_task()
    model.fc1.weight.requires_grad_(False)
    frozen, outside = model.fc1.weight.clone(), model.fc2.bias.clone()
    held = [p for n, p in model.named_parameters() if n != "fc2.bias"]
    step = build_train_network(model, torch.optim.SGD(held, lr=0.1), nn.CrossEntropyLoss(), level="O2",
                               dtype=torch.bfloat16)
    step(*batches[0])
    assert torch.equal(frozen, model.fc1.weight) and torch.equal(outside, model.fc2.bias)
    assert model.fc1.weight.grad is None and model.fc2.bias.grad is None
    assert model.fc2.weight.grad is not None


# --- bad input ---------------------------------------------------------------------------------------
def test_a_loss_that_is_not_a_scalar_is_named():
    model, batches = tiny_task()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(reduction="none"), level="O2", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scalar loss .* shape \(16,\)"):
        step(*batches[0])


def test_an_optimizer_without_the_models_parameters_is_named():
    model, _ = tiny_task()
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="none of the model's parameters"):
        build_train_network(model, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss())


def test_a_missing_label_is_named():
    model, batches = tiny_task()
    step = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                               level="O2", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="label is missing"):
        step(batches[0][0])


def test_low_precision_master_weights_and_bad_managers_are_refused():
    model, _ = tiny_task()
    with pytest.raises(TypeError, match="loss_scale_manager must be a LossScaleManager"):
        build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                            loss_scale_manager=128.0)
    model.half()
    with pytest.raises(ValueError, match="master weights must stay fp32"):
        build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())


# --- the demo and the zoo ----------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_training_says_the_first_skips_are_the_scale_calibrating_itself():
    task = build("mlp")
    before = copy.deepcopy(task.model.state_dict())
    rows, report = demo_training(task, steps=5, level="O2", loss_scale_manager=DynamicLossScaleManager())
    assert [r[0] for r in rows] == list(range(5))
    assert rows[0][2] == 2 ** 24 and rows[0][3] is Overflow.SKIPPED        # the seeds' scale starts too high
    assert rows[0][4] == "skipped: the scale is calibrating itself (2**24 -> 2**23)"
    skipped = sum(bool(r[3]) for r in rows)
    assert report.startswith(f"5 steps: {5 - skipped} applied, {skipped} skipped")
    assert f"{skipped} while the dynamic scale calibrated itself from 2**24 down to" in report
    assert all(math.isfinite(r[1]) for r in rows)
    assert all(torch.equal(v, task.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.slow
def test_demo_training_default_starts_at_2_16_and_says_so_when_nothing_is_skipped():
    rows, report = demo_training(build("mlp"), steps=3, level="O2")
    assert rows[0][2] == 2 ** 16 and not any(r[3] for r in rows)
    assert report == "3 steps: 3 applied, 0 skipped with inf/nan gradients"


APPLIED_STEPS = 30
TOLERANCE = 0.05


def train_zoo(name, level, dtype):
    """Train `name` for APPLIED_STEPS updates (an overflowing step is retried on the same batch); return
    the training losses and the eval-mode fp32 loss on held-out batches. Dropout is seeded per update so
    that skipped steps do not shift the masks of the steps that follow."""
    task = build(name)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    step = build_train_network(task.model, optimizer, task.loss_fn, level=level, dtype=dtype,
                               example_inputs=task.example_inputs)
    losses, attempts = [], 0
    while len(losses) < APPLIED_STEPS:
        attempts += 1
        assert attempts <= 3 * APPLIED_STEPS, f"{name} {level}: too many skipped steps"
        inputs, target = task.make_batch(len(losses))
        torch.manual_seed(1000 + len(losses))
        loss, overflow, _ = step(*inputs, target)
        if not overflow:
            losses.append(float(loss))
    task.model.eval()
    with torch.no_grad():
        held_out = [task.make_batch(10_000 + k) for k in range(2)]
        eval_loss = sum(float(task.loss_fn(task.model(*i), t)) for i, t in held_out) / len(held_out)
    return losses, eval_loss


@functools.lru_cache(maxsize=None)
def fp32_reference(name):
    return train_zoo(name, "O0", torch.float16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_trains_in_mixed_precision_like_fp32(name, level, dtype):
    reference_losses, reference_eval = fp32_reference(name)
    assert sum(reference_losses[-5:]) < 0.95 * 5 * reference_losses[0], f"{name} does not learn in fp32"
    losses, eval_loss = train_zoo(name, level, dtype)
    assert all(math.isfinite(v) for v in losses + [eval_loss])
    late, reference_late = sum(losses[-5:]) / 5, sum(reference_losses[-5:]) / 5
    assert abs(late - reference_late) <= TOLERANCE * reference_late, (late, reference_late)
    assert abs(eval_loss - reference_eval) <= TOLERANCE * reference_eval, (eval_loss, reference_eval)
