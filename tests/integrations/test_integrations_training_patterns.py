"""The integrations (apex.py, lightning.py, huggingface.py, accelerate.py) in common training patterns: eval after
a low-weights step, initialize twice, a backward outside scale_loss, a scheduler built first, gradient accumulation,
manual optimization with two optimizers; each test rules out a silently wrong result or a crash."""
import copy
import logging
import warnings

import pytest
import torch
from torch import nn

from amp_compiler import apex


def _tiny_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 4))


def _one_apex_step(model, optimizer, x):
    loss = model(x).float().pow(2).mean()
    optimizer.zero_grad()
    with apex.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_eval_after_a_training_step_with_low_weights_runs_the_eval_graph(level):
    """Validation after a step: the eval-mode capture found the low weights' gradients (bf16) on the fp32
    copies it traces with, failed, and the fallback 'as written' crashed on fp32 inputs against bf16 weights."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = apex.initialize(model, optimizer, opt_level=level, cast_model_type=torch.bfloat16,
                                       verbosity=0)
    x = torch.randn(2, 8)
    _one_apex_step(model, optimizer, x)
    grads = [p.grad.clone() for p in model.parameters()]
    model.eval()
    with torch.no_grad():
        out = model(x)
        weights = [p.float() for p in model.parameters()]
        reference = torch.relu(x.bfloat16() @ weights[0].bfloat16().t() + weights[1].bfloat16()).float()
        reference = (reference.bfloat16() @ weights[2].bfloat16().t() + weights[3].bfloat16()).float()
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), "capture changed the grads"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_second_initialize_of_the_same_o2_model_says_initialize_once():
    """It said 'Call model.float() first': following that advice converts the weights a second time and
    leaves the first masters stale."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="call initialize once"):
        apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="call initialize once"):
        apex.initialize(model, opt_level="O2", verbosity=0)


def test_o2_step_after_a_backward_outside_scale_loss_raises_instead_of_doing_nothing():
    """The masters get gradients only in scale_loss: a plain loss.backward() left them None and step()
    silently moved nothing."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model(torch.randn(2, 8)).float().sum().backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        optimizer.step()


def test_a_scheduler_built_before_initialize_keeps_working_without_a_warning():
    """torch warned 'optimizer.step() has been overridden after learning rate scheduler initialization' at
    every run where the scheduler came first (Apex's examples build it either way)."""
    model = _tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model, optimizer = apex.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.bfloat16,
                                       verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _one_apex_step(model, optimizer, torch.randn(2, 8))
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)


# -- Lightning ---------------------------------------------------------------------------------------------------
def _lightning_module(inf_batch=None):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == inf_batch:
                x = x.clone()
                x[0, 0] = float("inf")
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)
    return Tiny()


def _lightning_fit(module, plugins=(), **settings):
    import lightning.pytorch as pl
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=generator),
                                          torch.randint(0, 4, (8,), generator=generator))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=list(plugins), **settings)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return trainer


def _flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_lightning_fp16_gradient_accumulation_scales_once_per_step_and_names_the_replayed_micro_batch():
    """Accumulated fp16 steps follow fp32's; an inf in the window's FIRST micro-batch skips the step, and the
    report says the replay (the window's last micro-batch) may miss it instead of blaming another rank."""
    from amp_compiler.lightning import AmpPrecision
    reference, amp = _lightning_module(), _lightning_module()
    _lightning_fit(reference, max_steps=2, accumulate_grad_batches=2)
    _lightning_fit(amp, [AmpPrecision("O1", dtype=torch.float16)], max_steps=2, accumulate_grad_batches=2)
    start = _flat(_lightning_module())
    assert (_flat(reference) - start).norm() > 0.1
    assert (_flat(amp) - _flat(reference)).norm() <= 1e-2 * (_flat(reference) - start).norm()

    skipped = _lightning_module(inf_batch=0)
    plugin = AmpPrecision("O1", dtype=torch.float16)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lightning.pytorch.amp_compiler").addHandler(handler)
    try:
        _lightning_fit(skipped, [plugin], max_steps=1, accumulate_grad_batches=2)
    finally:
        logging.getLogger("lightning.pytorch.amp_compiler").removeHandler(handler)
    assert torch.equal(_flat(skipped), start)   # the window's step was skipped: nothing moved
    assert plugin.scaler.get_scale() == 2.0 ** 15
    warning = next(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert "last of the 2 accumulated micro-batches" in warning, warning


def _two_optimizer_module(one_backward: bool, inf_batch=None):
    """Manual optimization: one loss feeding two optimizers' steps, or the GAN pattern (a backward each)."""
    import lightning.pytorch as pl

    class TwoOptimizers(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == inf_batch:
                x = x.clone()
                x[0, 0] = float("inf")
            first, second = self.optimizers()
            if one_backward:
                first.zero_grad()
                second.zero_grad()
                self.manual_backward(nn.functional.cross_entropy(self.b(self.a(x)), y))
                first.step()
                second.step()
                return
            first.zero_grad()
            self.manual_backward(self.b(self.a(x)).float().pow(2).mean())
            first.step()
            second.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self.b(self.a(x).detach()), y))
            second.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.a.parameters(), lr=0.5), torch.optim.SGD(self.b.parameters(), lr=0.5)
    return TwoOptimizers()


@pytest.mark.parametrize("one_backward", [True, False], ids=["one_backward_two_steps", "gan"])
def test_lightning_manual_optimization_with_two_optimizers_follows_fp32(one_backward):
    """One backward then two optimizer steps crashed ('unscale_() was called with no scale()'): the plugin
    updated the scale after the first step, as if the iteration had ended. The update now waits for the next
    backward (or a checkpoint); an inf skips both steps and halves the scale once."""
    from amp_compiler.lightning import AmpPrecision
    reference, amp = _two_optimizer_module(one_backward), _two_optimizer_module(one_backward)
    _lightning_fit(reference, max_steps=4)
    _lightning_fit(amp, [AmpPrecision("O1", dtype=torch.float16)], max_steps=4)
    start = _flat(_two_optimizer_module(one_backward))
    assert (_flat(reference) - start).norm() > 0.1
    assert (_flat(amp) - _flat(reference)).norm() <= 1e-2 * (_flat(reference) - start).norm()
    if one_backward:
        skipped, plugin = _two_optimizer_module(True, inf_batch=0), AmpPrecision("O1", dtype=torch.float16)
        _lightning_fit(skipped, [plugin], max_steps=2)   # manual: max_steps counts each optimizer's step
        assert torch.equal(_flat(skipped), start)
        assert plugin.state_dict()["loss_scale"] == 2.0 ** 15


# -- Accelerate ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerator():
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_accelerate_fp16_accumulation_follows_fp32_and_a_finite_replay_names_the_other_micro_batches(
        fresh_accelerator, caplog):
    """accelerator.accumulate with fp16: one unscale and one skip per window. An inf in the window's first
    micro-batch skips the step; explain_overflow replaying another micro-batch stays finite, and the warning
    now names that possibility (it blamed only state the replay does not restore)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    import amp_compiler.accelerate as amp_accelerate
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 8, generator=generator), torch.randint(0, 4, (2,), generator=generator))
            for _ in range(4)]

    def train(amp: bool, inf_at=None):
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(mixed_precision="no", cpu=True, gradient_accumulation_steps=2)
        model = _tiny_mlp().eval()   # no dropout: the runs compare directly
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        prepare = amp_accelerate.prepare if amp else lambda acc, *objects, **_: acc.prepare(*objects)
        model, optimizer = prepare(accelerator, model, optimizer, dtype=torch.float16)
        skipped = []
        for index, (x, y) in enumerate(data):
            if index == inf_at:
                x = x.clone()
                x[0, 0] = float("inf")
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    skipped.append(optimizer.step_was_skipped)
        return model, accelerator, skipped

    reference, _, _ = train(False)
    ours, accelerator, skipped = train(True)
    start = _flat(_tiny_mlp())
    assert skipped == [False, False] and (_flat(reference) - start).norm() > 0.1
    assert (_flat(ours) - _flat(reference)).norm() <= 1e-2 * (_flat(reference) - start).norm()

    model, accelerator, skipped = train(True, inf_at=0)
    assert skipped == [True, False] and accelerator.scaler.get_scale() == 2.0 ** 15
    x, y = data[1]
    with caplog.at_level(logging.WARNING, logger="amp_compiler.accelerate"):
        report = amp_accelerate.explain_overflow(accelerator, model,
                                                 lambda: nn.functional.cross_entropy(model(x), y))
    assert report is None and "another micro-batch" in caplog.text
