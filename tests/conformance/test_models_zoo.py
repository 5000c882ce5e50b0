"""Model zoo: every model builds, traces, runs in fp32/bf16 and learns its task."""
import pytest
import torch
import torch.fx

import models

SMALL_TASK_STEPS = 30
HELD_OUT_STEP = 10_000


@pytest.fixture(params=models.ZOO_NAMES)
def task(request):
    return models.build(request.param, size="small", seed=0)


def _cast_inputs(inputs, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def test_build_returns_fresh_fp32_task(task):
    assert isinstance(task, models.ZooTask)
    assert task.name in models.ZOO_NAMES
    assert isinstance(task.model, torch.nn.Module)
    assert all(p.dtype == torch.float32 for p in task.model.parameters())
    assert all(b.dtype != torch.float64 for b in task.model.buffers())
    assert all(x.dtype != torch.float64 for x in task.example_inputs)
    again = models.build(task.name, size="small", seed=0)
    assert again.model is not task.model
    for (name, value), (_, value_again) in zip(task.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(value, value_again), name


def test_make_batch_is_deterministic_per_step(task):
    inputs_a, target_a = task.make_batch(3)
    inputs_b, target_b = task.make_batch(3)
    assert all(torch.equal(a, b) for a, b in zip(inputs_a, inputs_b))
    assert torch.equal(target_a, target_b)
    assert target_a.dtype != torch.float64


def test_example_forward_shape_and_finite_loss(task):
    task.model.eval()
    with torch.no_grad():
        output = task.model(*task.example_inputs)
    _, target = task.make_batch(0)
    assert output.dtype == torch.float32
    assert output.shape[-1] == task.num_classes
    assert output.shape[:-1] == target.shape
    loss = task.loss_fn(output, target)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_symbolic_trace_matches_eager(task):
    task.model.eval()
    traced = torch.fx.symbolic_trace(task.model)
    with torch.no_grad():
        torch.testing.assert_close(traced(*task.example_inputs), task.model(*task.example_inputs))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_backward_runs(task, dtype):
    torch.manual_seed(0)
    model = task.model.to(dtype).train()
    inputs, target = task.make_batch(0)
    output = model(*_cast_inputs(inputs, dtype))
    assert output.dtype == dtype
    loss = task.loss_fn(output.float(), target)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
def test_fp32_training_lowers_loss(task):
    def held_out_loss():
        task.model.eval()
        inputs, target = task.make_batch(HELD_OUT_STEP)
        with torch.no_grad():
            return task.loss_fn(task.model(*inputs), target).item()

    torch.manual_seed(0)
    initial_loss = held_out_loss()
    optimizer = torch.optim.Adam(task.model.parameters(), lr=1e-2)
    task.model.train()
    for step in range(SMALL_TASK_STEPS):
        inputs, target = task.make_batch(step)
        loss = task.loss_fn(task.model(*inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_out_loss() < 0.7 * initial_loss


def test_build_rejects_unknown_name():
    with pytest.raises(ValueError, match="mlp"):
        models.build("transformer-xl")


def test_build_rejects_unknown_size():
    with pytest.raises(ValueError, match="size"):
        models.build("mlp", size="huge")
