"""Apex's amp API (amp_compiler/apex.py): the cases of Apex's tests/L0/run_amp that run on a CPU, ported.

Per level: the dtypes initialize leaves, the fp32 masters the optimizer steps and the model following them;
training against a reference written in plain torch (the same casts by hand, the scale by hand); skipped
steps (an inf injected into a gradient: the step is skipped, the scale halves, nothing moves); several
models, optimizers and losses (test_multiple_models_optimizers_losses.py); add_param_group after initialize
(test_add_param_group.py); checkpoints continuing identically (test_checkpointing.py). fp16 on tiny shapes
(fp16 matmul is slow on a CPU), bf16 elsewhere.
"""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler import apex


LEVELS = ("O0", "O1", "O2", "O3")


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class ApexModel(nn.Module):
    """Apex's MyModel (two weights, loss = sum(x * w0 * w1)); both fp32 here: initialize refuses low models."""

    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


class ConvBnModel(nn.Module):
    """test_checkpointing.py's MyModel, smaller."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(4)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn1(F.relu(self.conv1(x * self.param)))


def set_scales(*scales):
    """Apex's tests set `_amp_state.loss_scalers[i]._loss_scale`; here through the public load_state_dict."""
    amp_compiler.load_state_dict({f"loss_scaler{i}": {"loss_scale": s, "unskipped": 0} for i, s in enumerate(scales)})


def scales():
    return [entry["loss_scale"] for entry in amp_compiler.state_dict().values()]


def zero(models, optimizer, how):
    if how == "none":
        for model in models:
            for param in model.parameters():
                param.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        optimizer.zero_grad()


# -- initialize: what each level does ---------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_levels_leave_apex_dtypes_and_masters(level):
    torch.manual_seed(0)
    model = TinyNet()
    fp32 = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    returned = amp_compiler.initialize(model, optimizer, opt_level=level, cast_model_type=None if level == "O0"
                                       else torch.bfloat16, verbosity=0)
    assert returned[0] is model and returned[1] is optimizer   # in place, as Apex
    low_weights = level in ("O2", "O3")
    norm_low = level == "O3"   # keep_batchnorm_fp32: Apex's O2 default True, O3 False
    for name, param in model.named_parameters():
        low = norm_low if name.startswith("norm") else low_weights
        assert param.dtype == (torch.bfloat16 if low else torch.float32), name
    masters = list(amp_compiler.master_params(optimizer))
    assert all(m is p for m, p in zip(masters, [p for g in optimizer.param_groups for p in g["params"]]))
    if level == "O2":   # fp32 masters in the param groups, equal to the fp32 weights (not their rounding)
        assert all(m.dtype == torch.float32 for m in masters)
        assert [torch.equal(m, w) for m, w in zip(masters, fp32.values())] == [True] * len(masters)
        own = [m is p for m, p in zip(masters, model.parameters())]   # the fp32 norms are their own masters
        assert own == [name.startswith("norm") for name in fp32]
    else:   # the optimizer steps the model's own parameters
        assert all(m is p for m, p in zip(masters, model.parameters()))
    from amp_compiler.converted import compiled_record
    assert (compiled_record(model) is None) == (level == "O0")


def test_o2_keep_batchnorm_fp32_false_casts_norms_and_their_statistics():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_compiler.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32="False",
                            cast_model_type=torch.bfloat16, verbosity=0)
    assert model.norm.weight.dtype == model.norm.running_mean.dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for m in amp_compiler.master_params(optimizer))
    model(torch.randn(5, 4)).float().sum().backward()   # the low norm runs in its graph


def test_lists_in_lists_out_and_models_alone():
    models, optimizers = [ApexModel(1), ApexModel(2)], [torch.optim.SGD(ApexModel(3).parameters(), lr=1)]
    returned = amp_compiler.initialize(models, optimizers, opt_level="O1", verbosity=0)
    assert returned[0] is models and returned[1] is optimizers
    model = ApexModel(4)
    assert amp_compiler.initialize(model, opt_level="O2", verbosity=0) is model
    assert model.weight0.dtype == torch.float16
    model, optimizer = ApexModel(5), torch.optim.SGD(ApexModel(6).parameters(), lr=1)
    assert amp_compiler.initialize([model], optimizer, opt_level="O0", verbosity=0) == ([model], optimizer)


def test_enabled_false_changes_nothing():
    model = TinyNet().eval()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert amp_compiler.initialize(model, optimizer, opt_level="O2", enabled=False) == (model, optimizer)
    loss = model(torch.randn(5, 4)).sum()
    with amp_compiler.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "step" not in optimizer.__dict__ and "_amp_compiled" not in model.__dict__
    other = torch.optim.SGD(model.parameters(), lr=0.1)   # not given to it: Apex's scale_loss yields it as it is
    with amp_compiler.scale_loss(loss, other) as scaled:
        assert scaled is loss


# -- training against a plain-torch reference -----------------------------------------------------------
def reference_o2_step(weight, bias, momentum, x, y, low, scale, lr=0.5, beta=0.5):
    """One O2 step by hand: the linear in `low` on rounded weights, the loss in fp32 and scaled, the gradient
    unscaled in fp32; inf/nan: no step and half the scale (Apex's dynamic rule), else SGD with momentum on
    the fp32 weights. Returns the weights, the bias and the scale."""
    w, b = weight.detach().requires_grad_(), bias.detach().requires_grad_()
    out = F.linear(x.to(low), w.to(low), b.to(low)).float()
    (F.mse_loss(out, y) * scale).backward()
    grads = [w.grad / scale, b.grad / scale]
    if not all(g.isfinite().all() for g in grads):
        return weight, bias, scale / 2
    updated = []
    for value, grad, buf in zip((weight, bias), grads, momentum):
        buf.mul_(beta).add_(grad) if buf.numel() else buf.set_(grad.clone())
        updated.append(value - lr * buf)
    return (*updated, scale)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_o2_trains_like_the_hand_written_reference(low):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Linear(3, 2)
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    momentum = [torch.empty(0), torch.empty(0)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    amp_compiler.initialize(model, optimizer, opt_level="O2", cast_model_type=low, verbosity=0)
    scale = scales()[0]
    assert scale == (2.0 ** 16 if low == torch.float16 else 1.0)   # bf16: fp32's range, no scaling
    skipped = 0
    for _ in range(6):
        x, y = torch.randn(4, 3), torch.randn(4, 2)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp_compiler.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        weight, bias, new_scale = reference_o2_step(weight, bias, momentum, x, y, low, scale)
        skipped, scale = skipped + (new_scale != scale), new_scale
        master_weight, master_bias = amp_compiler.master_params(optimizer)
        assert torch.equal(master_weight, weight) and torch.equal(master_bias, bias)
        assert torch.equal(model.weight, master_weight.to(low))   # the model follows its masters
        assert scales() == [scale]
    # fp16: 2**16 overflows these gradients: the first steps calibrate the scale, then steps are taken
    assert 0 < skipped < 6 if low == torch.float16 else skipped == 0
    from amp_compiler.dynamo import graphs   # the graphs dynamo captured after the cast read the low weights
    assert graphs(model) and "torch.dynamo" in str(amp_compiler.explain(model))


@pytest.mark.parametrize("model_class", [TinyNet, ConvBnModel])
def test_o2_on_dynamo_runs_a_model_whose_code_mixes_its_input_with_a_low_weight(model_class):
    """`x * self.param` before a conv: with the weights low, an fp32 input fails in dynamo's trace as in eager;
    the input is cast to the weights' dtype, as Apex's O2 forward does, and the result is close to fp32's."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = model_class().eval()
    reference = copy.deepcopy(model)
    amp_compiler.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O2",
                            cast_model_type=torch.bfloat16, verbosity=0)
    x = torch.randn(5, 4) if model_class is TinyNet else torch.randn(2, 3, 5, 5)
    out, expected = model(x), reference(x)
    assert out.dtype == torch.float32 and amp_compiler.dynamo.graphs(model)
    assert (out - expected).abs().max() <= 0.05 * expected.abs().max()


def test_restore_removes_the_input_and_output_casts_of_o2_on_dynamo():
    model = TinyNet()
    amp_compiler.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O2",
                            cast_model_type=torch.bfloat16, verbosity=0)
    assert model(torch.randn(5, 4)).dtype == torch.float32 and model._forward_pre_hooks and model._forward_hooks
    amp_compiler.restore(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


# -- skipped steps ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inf_in_a_gradient_skips_the_step_and_halves_the_scale(level):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp_compiler.initialize(model, optimizer, opt_level=level, verbosity=0)   # fp16, from 2**16
    x = torch.randn(4, 3)

    def step(inject):
        optimizer.zero_grad()
        with amp_compiler.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
            if inject:
                model.weight.grad[0, 0] = float("inf")
        return optimizer.step()

    step(False)
    weights = [p.detach().clone() for p in (*model.parameters(), *amp_compiler.master_params(optimizer))]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in amp_compiler.master_params(optimizer)]
    assert step(True) is None
    assert scales() == [2.0 ** 15]
    after = [*model.parameters(), *amp_compiler.master_params(optimizer)]
    assert all(torch.equal(a, b) for a, b in zip(weights, after))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m)
               for p, m in zip(amp_compiler.master_params(optimizer), momentum))
    assert amp_compiler.state_dict()["loss_scaler0"]["unskipped"] == 0
    step(False)   # the skip was for one step only
    assert not torch.equal(model.weight, weights[0])


def test_min_and_max_loss_scale_bound_the_dynamic_scale():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_compiler.initialize(model, optimizer, opt_level="O1", min_loss_scale=256.0, max_loss_scale=1024.0,
                            verbosity=0)
    assert scales() == [1024.0]   # Apex: min(2**16, max_loss_scale)
    scaler = optimizer._amp_stash.amp.scalers[0]
    scaler.set_growth_interval(1)

    def step(inject):
        with amp_compiler.scale_loss(model(torch.ones(1, 3)).sum(), optimizer) as scaled:
            scaled.backward()
            model.weight.grad.fill_(float("nan") if inject else 0.0)
        optimizer.step()
        return scales()[0]

    assert [step(False), step(True), step(True), step(True), step(False)] == [1024.0, 512.0, 256.0, 256.0, 512.0]


def test_bf16_needs_no_scale_unless_one_is_given():
    model = nn.Linear(3, 2)
    amp_compiler.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O1",
                            cast_model_type=torch.bfloat16, verbosity=0)
    assert scales() == [1.0]
    model = nn.Linear(3, 2)
    amp_compiler.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O2",
                            cast_model_type=torch.bfloat16, loss_scale="128.0", verbosity=0)
    assert scales() == [128.0]


# -- several models, optimizers and losses (test_multiple_models_optimizers_losses.py) ------------------------
def reference_training(models, groups, losses, steps):
    """Plain fp32 SGD: the gradients of each step and the final parameters."""
    optimizer = torch.optim.SGD([{"params": m.parameters(), "lr": lr} for m, lr in zip(models, groups)],
                                momentum=0.125)
    grads = []
    for _ in range(steps):
        optimizer.zero_grad()
        for loss in losses(models):
            loss.backward()
        grads.append([p.grad.clone() for m in models for p in m.parameters()])
        optimizer.step()
    return grads, [p.detach().clone() for m in models for p in m.parameters()]


def inject_cases(level):
    """(iteration, which backward, which model parameter) to set inf in; Apex tries them at O1 and O2."""
    if level not in ("O1", "O2"):
        return [(-1, None, None)]
    return [(-1, None, None)] + [(i, b, w) for i in (0, 1) for b in (0, 1) for w in ("weight0", "weight1")]


@pytest.mark.parametrize("level, how_to_zero, num_losses", [
    pytest.param(*case, marks=() if case[0] == "O2" or case[1] == "optimizer" else pytest.mark.slow)
    for case in itertools.product(LEVELS, ("none", "model", "optimizer"), (1, 2))])
def test_2models_2losses_1optimizer(level, how_to_zero, num_losses):
    def losses(models):
        return [models[0](x), models[1](x)]

    x = torch.ones(2)
    reference_grads, final = reference_training([ApexModel(1), ApexModel(2)], (0.25, 0.5), losses, 2)
    loss_ids = [0, 1] if num_losses == 2 else [0, 0]
    for inject, which_backward, which_weight in inject_cases(level):
        models = [ApexModel(1), ApexModel(2)]
        optimizer = torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25},
                                     {"params": models[1].parameters(), "lr": 0.5}], momentum=0.125)
        models, optimizer = amp_compiler.initialize(models, optimizer, opt_level=level, num_losses=num_losses,
                                                    verbosity=0)
        set_scales(*[4.0, 16.0][:num_losses])
        unskipped = 0
        for i in range(3 if inject >= 0 else 2):
            zero(models, optimizer, how_to_zero)
            for index, (loss, loss_id) in enumerate(zip(losses(models), loss_ids)):
                with amp_compiler.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
                    scaled.backward()
                    if i == inject and which_backward == index:
                        getattr(models[index], which_weight).grad[0] = float("inf")
            if i != inject:
                for master, expected in zip(amp_compiler.master_params(optimizer), reference_grads[unskipped]):
                    torch.testing.assert_close(master.grad.float(), expected)
                unskipped += 1
            optimizer.step()
        params = [p for m in models for p in m.parameters()]
        for param, master, expected in zip(params, amp_compiler.master_params(optimizer), final):
            torch.testing.assert_close(param.float(), expected, rtol=1e-3, atol=1e-3)
            assert torch.equal(param, master.to(param.dtype))
        if inject >= 0:   # the scaler of the backward that overflowed halved
            halved = [4.0, 16.0][:num_losses]
            halved[loss_ids[which_backward]] /= 2
            assert scales() == halved


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_2models_2optimizers_1loss_share_the_skip(level):
    def losses(models):
        return [models[0](x) + models[1](x)]

    x = torch.ones(2)
    _, final = reference_training([ApexModel(1), ApexModel(2)], (0.25, 0.5), losses, 2)
    models = [ApexModel(1), ApexModel(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.125) for m, lr in zip(models, (0.25, 0.5))]
    models, optimizers = amp_compiler.initialize(models, optimizers, opt_level=level, verbosity=0)
    set_scales(4.0)   # fp16 holds 4 * these gradients (2**16 * them overflows)
    for i in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        with amp_compiler.scale_loss(losses(models)[0], optimizers) as scaled:
            scaled.backward()
            if i == 1:
                models[1].weight1.grad[0] = float("inf")
        for optimizer in optimizers:
            optimizer.step()   # both skip at i == 1: the overflow was in their common loss
    params = [p for m in models for p in m.parameters()]
    for param, expected in zip(params, final):
        torch.testing.assert_close(param.float(), expected, rtol=1e-3, atol=1e-3)


# -- add_param_group after initialize (test_add_param_group.py) ----------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("zero_before_add", [True, False])
@pytest.mark.parametrize("try_accumulation", [True, False])
def test_add_param_group(level, zero_before_add, try_accumulation):
    x = torch.ones(2)

    def train(models, optimizer, backward):
        def iteration():
            loss = models[0](x) + models[1](x)
            backward(loss, retain_graph=try_accumulation)
            if try_accumulation:
                backward(loss)
            optimizer.step()

        optimizer.zero_grad()
        backward(models[0](x))
        optimizer.step()
        if zero_before_add:
            optimizer.zero_grad()
        optimizer.add_param_group({"params": models[1].parameters(), "lr": 0.5})
        if not zero_before_add:
            optimizer.zero_grad()
        iteration()
        optimizer.zero_grad()   # once more: the new parameters pick up momentum
        iteration()
        return [p for m in models for p in m.parameters()]

    def plain_backward(loss, retain_graph=False):
        loss.backward(retain_graph=retain_graph)

    def amp_backward(loss, retain_graph=False):
        with amp_compiler.scale_loss(loss, optimizer) as scaled:
            scaled.backward(retain_graph=retain_graph)

    models = [ApexModel(1), ApexModel(2)]
    reference = train(models, torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25}], momentum=0.125),
                      plain_backward)
    models = [ApexModel(1), ApexModel(2)]
    optimizer = torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25}], momentum=0.125)
    models, optimizer = amp_compiler.initialize(models, optimizer, opt_level=level, verbosity=0)
    set_scales(4.0)
    final = train(models, optimizer, amp_backward)
    for expected, param in zip(reference, final):
        torch.testing.assert_close(param, expected.detach().to(param.dtype))
    if level == "O2":   # the added group holds fp32 masters too, and the model follows them
        added = optimizer.param_groups[1]["params"]
        assert all(m.dtype == torch.float32 for m in added)
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(models[1].parameters(), added))


# -- checkpoints (test_checkpointing.py) ---------------------------------------------------------------------
def checkpoint_train_step(model, optimizer, data, loss_ids):
    optimizer.zero_grad()
    output = model(data)
    for loss_id in loss_ids:
        with amp_compiler.scale_loss(output.float().mean(), optimizer, loss_id=loss_id) as scaled:
            scaled.backward(retain_graph=True)
    optimizer.step()
    return output


FAST_CHECKPOINT_CASES = {("O0", 1, False), ("O1", 2, True), ("O2", 1, False), ("O2", 2, True), ("O3", 1, True)}


@pytest.mark.parametrize("level, num_losses, amp_before_load", [
    pytest.param(*case, marks=() if case in FAST_CHECKPOINT_CASES else pytest.mark.slow)
    for case in itertools.product(LEVELS, (1, 2), (True, False))])
def test_checkpoint_restores_training_exactly(level, num_losses, amp_before_load):
    epochs, restore_at = 6, 3
    low = {} if level == "O0" else {"cast_model_type": torch.bfloat16, "loss_scale": "dynamic"}

    def initialize(model, optimizer):
        return amp_compiler.initialize(model, optimizer, opt_level=level, num_losses=num_losses * 2,
                                       verbosity=0, **low)

    torch.manual_seed(2809)
    model = ConvBnModel()
    model, optimizer = initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.5))
    data = [torch.randn(2, 3, 5, 5) for _ in range(epochs)]
    outputs, checkpoint = [], None
    for epoch in range(epochs):
        outputs.append(checkpoint_train_step(model, optimizer, data[epoch], range(num_losses)).detach())
        if epoch == restore_at - 1:
            if level in ("O1", "O2"):   # a skipped step before saving: the scale to restore is not the initial
                loss = model(data[epoch]).float().mean()
                with amp_compiler.scale_loss(loss, optimizer, loss_id=num_losses) as scaled:
                    scaled.backward()
                    next(model.parameters()).grad.fill_(float("inf"))
                optimizer.step()
            checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                        "amp": amp_compiler.state_dict()})
    final_params, final_amp = copy.deepcopy(model.state_dict()), amp_compiler.state_dict()
    assert all(v.dtype != torch.bfloat16 for v in checkpoint["model"].values()), "model state_dict is fp32"

    restored = ConvBnModel()
    restored_optimizer = torch.optim.SGD(restored.parameters(), lr=1e-3, momentum=0.5)
    if amp_before_load:
        restored, restored_optimizer = initialize(restored, restored_optimizer)
    restored.load_state_dict(checkpoint["model"])
    restored_optimizer.load_state_dict(checkpoint["optimizer"])
    if not amp_before_load:
        restored, restored_optimizer = initialize(restored, restored_optimizer)
    amp_compiler.load_state_dict(checkpoint["amp"])
    for epoch in range(restore_at, epochs):
        output = checkpoint_train_step(restored, restored_optimizer, data[epoch], range(num_losses))
        assert torch.equal(output, outputs[epoch]), f"epoch {epoch}"
    assert all(torch.equal(final_params[k], v) for k, v in restored.state_dict().items())
    assert amp_compiler.state_dict() == final_amp


def test_loss_scale_decrease_per_loss_and_in_state_dict():
    """test_checkpointing.py's test_loss_scale_decrease: loss i overflows i times, only its scaler halves."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp_compiler.initialize(model, optimizer, opt_level="O2", num_losses=3, verbosity=0)
    for loss_id, decreases in enumerate((0, 1, 2)):
        for _ in range(decreases):
            optimizer.zero_grad()
            with amp_compiler.scale_loss(model(torch.full((1, 3), 2.0 ** 17)).float().mean(), optimizer,
                                         loss_id=loss_id) as scaled:
                scaled.backward()   # 2**17 * 2**16 overflows fp16
            optimizer.step()
    assert amp_compiler.state_dict() == {f"loss_scaler{i}": {"loss_scale": 2.0 ** 16 / 2 ** i, "unskipped": 0}
                                         for i in range(3)}


@pytest.mark.parametrize("level", [pytest.param(level, marks=pytest.mark.slow) for level in ("O0", "O1")] + ["O2"])
def test_state_dict_is_fp32_and_training_goes_on(level):
    """test_checkpointing.py's test_state_dict: no low tensor in model.state_dict(); the loss decreases."""
    torch.manual_seed(0)
    model = ConvBnModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp_compiler.initialize(model, optimizer, opt_level=level, verbosity=0,
                                               **({} if level == "O0" else {"cast_model_type": torch.bfloat16}))
    assert all(not v.is_floating_point() or v.dtype == torch.float32 for v in model.state_dict().values())
    data, target = torch.randn(4, 3, 4, 4), torch.randn(4, 4, 4, 4)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data).float(), target)
        with amp_compiler.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


# -- odds and ends -------------------------------------------------------------------------------------------
def test_lr_scheduler_wraps_the_patched_step():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    amp_compiler.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    before = model.weight.detach().clone()
    with amp_compiler.scale_loss(model(torch.ones(1, 3)).sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    scheduler.step()
    assert not torch.equal(model.weight, before) and optimizer.param_groups[0]["lr"] == 0.5


def test_mistakes_are_named():
    with pytest.raises(ValueError, match="letter O"):
        amp_compiler.initialize(nn.Linear(2, 2), opt_level="02")
    with pytest.raises(ValueError, match="model.float()"):
        amp_compiler.initialize(nn.Linear(2, 2).half(), opt_level="O2")
    with pytest.raises(ValueError, match="loss_scale must be"):
        amp_compiler.initialize(nn.Linear(2, 2), opt_level="O1", loss_scale="big")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)
    amp_compiler.initialize(model, optimizer, opt_level="O1", verbosity=0)
    fresh = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="once"):
        amp_compiler.initialize(fresh, optimizer, opt_level="O1", verbosity=0)
    assert "_amp_compiled" not in fresh.__dict__, "a refused initialize changes nothing"
    with pytest.raises(ValueError, match="loss_id"):
        with amp_compiler.scale_loss(model(torch.ones(2)).sum(), optimizer, loss_id=1):
            pass
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(RuntimeError, match="did not go through"):
        with amp_compiler.scale_loss(model(torch.ones(2)).sum(), foreign):
            pass
    with pytest.raises(RuntimeError, match="unexpected keys"):
        amp_compiler.load_state_dict({"scaler": {}})


@pytest.mark.slow
@pytest.mark.real_models
def test_tiny_llama_trains_at_o2_like_fp32():
    """A Hugging Face decoder at O2 bf16, trained with labels: one graph on the bf16 weights; the loss follows
    the fp32 run's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    amp_compiler.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(3):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        with amp_compiler.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        expected = reference(input_ids=ids, labels=ids).loss
        expected.backward()
        reference_optimizer.step()
        assert loss.item() == pytest.approx(expected.item(), rel=5e-3)
    assert len(amp_compiler.dynamo.graphs(model)) == 1   # a call with labels is one graph


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delay_unscale_accumulates_scaled_gradients_for_the_next_scale_loss(level):
    """Apex's delay_unscale: the first backward's gradients stay scaled and the second scale_loss unscales
    both; the masters' gradients are the plain sum of both losses' gradients."""
    x = torch.ones(2)
    reference = ApexModel(1)
    (reference(x) + 2 * reference(x)).backward()
    model = ApexModel(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    amp_compiler.initialize(model, optimizer, opt_level=level, verbosity=0)
    set_scales(4.0)
    optimizer.zero_grad()
    with amp_compiler.scale_loss(model(x), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    if level == "O2":   # nothing unscaled into the masters yet
        assert all(m.grad is None for m in amp_compiler.master_params(optimizer))
    else:   # d(sum x * w0 * w1)/d w0 = w1, still times the scale
        assert torch.equal(model.weight0.grad, 4 * model.weight1.detach())
    with amp_compiler.scale_loss(2 * model(x), optimizer) as scaled:
        scaled.backward()
    for master, param in zip(amp_compiler.master_params(optimizer), reference.parameters()):
        assert torch.equal(master.grad, param.grad)


# -- state owned by each initialize (issue 31) ---------------------------------------------------------------
def test_two_initialize_calls_keep_their_own_scalers_skips_and_verbosity(capsys):
    """Each optimizer reaches its own initialize's state through its stash: a later initialize (another level,
    loss scale, verbosity, or enabled=False) changes nothing for the first. With one module-global state the
    first pair's scale_loss used the second's scale (128), its overflow message went silent, and after an
    enabled=False initialize its scale_loss yielded the loss unscaled and its step raised."""
    torch.manual_seed(0)
    first, second, third = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)
    first_optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    second_optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    amp_compiler.initialize(first, first_optimizer, opt_level="O2", verbosity=1)   # fp16, dynamic from 2**16
    amp_compiler.initialize(second, second_optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
    amp_compiler.initialize(third, torch.optim.SGD(third.parameters(), lr=0.1), opt_level="O2", enabled=False)
    capsys.readouterr()
    x = torch.ones(1, 3)

    def step(model, optimizer, inject=False):
        optimizer.zero_grad()
        loss = model(x).float().sum() / 4   # fp16 holds 2**16 times its gradients
        with amp_compiler.scale_loss(loss, optimizer) as scaled:
            scale = (scaled / loss).item()
            scaled.backward()
            if inject:
                model.weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        return scale, not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    assert step(first, first_optimizer) == (2.0 ** 16, True)
    assert step(second, second_optimizer) == (128.0, True)
    assert step(first, first_optimizer, inject=True) == (2.0 ** 16, False)   # skipped, the first's scale halves
    assert "skipping the step" in capsys.readouterr().out   # the first's verbosity, not the latest's
    assert step(second, second_optimizer) == (128.0, True)
    assert amp_compiler.state_dict(optimizer=first_optimizer)["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert amp_compiler.state_dict(optimizer=second_optimizer)["loss_scaler0"]["loss_scale"] == 128.0
    assert amp_compiler.state_dict() == {}   # Apex's argument-less one: the latest initialize's (disabled)
    amp_compiler.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}}, optimizer=first_optimizer)
    assert step(first, first_optimizer) == (4.0, True)
    assert step(second, second_optimizer) == (128.0, True)
    with pytest.raises(ValueError, match="different initialize"):
        with amp_compiler.scale_loss(first(x).sum(), [first_optimizer, second_optimizer]):
            pass


def test_initialize_enabled_false_then_true_on_the_same_optimizer():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_compiler.initialize(model, optimizer, opt_level="O2", enabled=False)
    amp_compiler.initialize(model, optimizer, opt_level="O2", verbosity=0)   # the first changed nothing
    assert model.weight.dtype == torch.float16
    assert all(m.dtype == torch.float32 for m in amp_compiler.master_params(optimizer))


def test_the_stash_owns_its_wrappers_and_unwrap_gives_the_optimizer_back():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)   # its wrapper of step, before initialize
    schedulers_step = optimizer.__dict__["step"]
    amp_compiler.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    stash = optimizer._amp_stash
    from amp_compiler.train.low_weights import MasterWeights
    assert isinstance(stash.masters, MasterWeights)   # low_weights()'s mechanism (LowWeights is one too)
    assert [pair.low for pair in stash.pairs] == list(model.parameters())
    assert {"step", "zero_grad", "add_param_group"} <= set(optimizer.__dict__)
    assert len(optimizer._optimizer_step_post_hooks) == 1   # the copy master -> model
    stash.unwrap()
    assert optimizer.__dict__["step"] is schedulers_step
    assert "zero_grad" not in optimizer.__dict__ and "add_param_group" not in optimizer.__dict__
    assert not optimizer._optimizer_step_post_hooks
    before = model.weight.detach().clone()
    with amp_compiler.scale_loss(model(torch.ones(1, 3)).sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()   # the optimizer's own step: the masters move, the model is no longer copied into
    scheduler.step()
    assert torch.equal(model.weight, before)
    assert not torch.equal(next(amp_compiler.master_params(optimizer)), before.float())
