"""amp_compiler.lightning: AmpPrecision in Lightning's Trainer and AmpFabricPrecision in Fabric, on CPU.

References are Lightning's own precision="bf16-mixed" runs (same weights, same batches); fp16 runs inject an
inf into one batch and check that exactly that step is skipped and the scale backs off."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.pytorch.strategies import FSDPStrategy

import amp_compiler
from amp_compiler.lightning import AmpFabricPrecision, AmpFSDPPrecision, AmpPrecision
from amp_testing import ProfiledDtypes

STEPS = 3
TRAINER_SETTINGS = dict(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
MATMULS = ("mm", "addmm", "bmm")
FP32_OPS = ("native_layer_norm", "_softmax", "_log_softmax", "nll_loss_forward")


class TinyAttention(nn.Module):
    """Linear -> LayerNorm -> softmax(h h^T) h -> Linear: matmuls run low, norm and softmax stay fp32."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        return self.fc2((h @ h.transpose(-1, -2)).softmax(-1) @ h)


class Classifier(pl.LightningModule):
    """training_step calls self.model directly (the LightningModule's forward is never run)."""

    def __init__(self, inf_at_step: int | None = None, inf_on_rank: int = 0, injected: float = float("inf")):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyAttention()
        self.inf_at_step, self.inf_on_rank, self.injected = inf_at_step, inf_on_rank, injected
        self.recorder: ProfiledDtypes | None = None
        self.losses, self.params_changed, self.scales = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.inf_at_step and self.global_rank == self.inf_on_rank:
            x = x.clone()
            x[0, 0, 0] = self.injected
        recording = self.recorder if self.recorder is not None and batch_idx > 0 else None   # after capture
        with recording or _nothing():
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self._before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.params_changed.append(any(not torch.equal(a, p) for a, p in zip(self._before, self.parameters())))
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def batches(count: int = STEPS):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count * 2, 5, 16, generator=generator)
    y = torch.randint(0, 4, (count * 2, 5), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


def fit(module: Classifier, **settings) -> pl.Trainer:
    trainer = pl.Trainer(**{**TRAINER_SETTINGS, **settings})
    trainer.fit(module, batches())
    return trainer


@pytest.fixture
def amp_log():
    """The lines the plugins log (Lightning's loggers do not propagate to pytest's handler)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(f"lightning.{side}.amp_compiler") for side in ("pytorch", "fabric")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


# -- Trainer ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capture", ["dynamo"])
def test_bf16_plugin_trains_like_bf16_mixed_with_matmuls_low_and_norms_fp32(amp_log, capture):
    reference = Classifier()
    fit(reference, precision="bf16-mixed")
    converted = Classifier()
    # a dispatch mode (AtenDtypeRecorder) makes dynamo run the frame as written: the profiler observes dynamo's graphs
    converted.recorder = ProfiledDtypes()
    trainer = fit(converted, plugins=[AmpPrecision("O1", dtype=torch.bfloat16, capture=capture)])

    assert trainer.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None
    assert len(converted.losses) == STEPS
    for ours, theirs in zip(converted.losses, reference.losses):
        assert abs(ours - theirs) <= 2e-2 * abs(theirs), (converted.losses, reference.losses)
    assert all(converted.params_changed)
    recorder = converted.recorder
    assert recorder.input_dtypes(*MATMULS) == {torch.bfloat16}
    for op in FP32_OPS:
        assert recorder.input_dtypes(op) == {torch.float32}, (op, dict(recorder.calls))
    # the child called by training_step is compiled: its graph, its rows under the LightningModule's paths;
    # the summary is logged once, after step 1
    report = amp_compiler.explain(converted)
    assert "torch.dynamo: 1 graph(s)" in str(report)
    assert {row["module"].split(".")[0] for row in report.rows if row["module"]} == {"model"}
    summaries = [r.getMessage() for r in amp_log if "amp-compiler report" in r.getMessage()]
    assert len(summaries) == 1 and "bfloat16" in summaries[0]


class CallsItsForward(Classifier):
    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("capture", ["dynamo"])
def test_a_training_step_calling_self_runs_the_lightning_modules_own_graph(capture):
    reference, converted = CallsItsForward(), CallsItsForward()
    fit(reference)
    fit(converted, plugins=[AmpPrecision(capture=capture)])
    # dynamo compiles the children: the forward's call of self.model is the child's graph
    report = amp_compiler.explain(converted)
    assert "torch.dynamo: 1 graph(s)" in str(report)
    assert {row["module"].split(".")[0] for row in report.rows if row["module"]} == {"model"}
    for ours, theirs in zip(converted.parameters(), reference.parameters()):
        assert not torch.equal(ours, theirs) and torch.allclose(ours, theirs, atol=2e-2, rtol=0)


@pytest.mark.parametrize("capture", ["dynamo"])
def test_fp16_overflow_skips_that_step_backs_the_scale_off_and_says_where(amp_log, capture):
    # 1e6 is finite in fp32 and past fp16's 65504: the graph's cast of the input to fp16 overflows
    module = Classifier(inf_at_step=1, injected=1e6)
    plugin = AmpPrecision("O1", dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 10),
                          capture=capture)
    fit(module, plugins=[plugin], max_steps=4)

    assert module.params_changed == [True, False, True, True]
    assert module.scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 9]
    skipped = [r.getMessage() for r in amp_log if "step skipped" in r.getMessage()]
    assert len(skipped) == 1 and "1 skipped so far" in skipped[0] and "1024" in skipped[0]
    report = plugin.scaler.last_overflow_report
    assert report is not None and report.forward["node"] is not None
    # the overflowing node is the cast of fc1's input (a cast goes with its reader's module), in the graph of the
    # compiled child 'model'
    assert report.forward["part"] == "model"
    assert report.forward["module"] == "model.fc1" and report.forward["op"] == "cast"
    assert report.forward["dtype"] == "float16" and str(report) in skipped[0]
    assert plugin.amp.skipped_steps == 1


def test_later_skipped_steps_log_only_the_count(amp_log):
    class AlwaysInf(Classifier):
        def training_step(self, batch, batch_idx):
            self.inf_at_step = self.global_step
            return super().training_step(batch, batch_idx)

    plugin = AmpPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 10))
    fit(AlwaysInf(), plugins=[plugin])
    skipped = [r.getMessage() for r in amp_log if "step skipped" in r.getMessage()]
    assert [f"{n} skipped so far" in line for n, line in enumerate(skipped, 1)] == [True] * STEPS
    assert "model input" in skipped[0] and all("overflowed" not in line for line in skipped[1:])


def test_gradient_clipping_sees_unscaled_gradients():
    seen = []

    class Clipped(Classifier):
        def on_before_optimizer_step(self, optimizer):
            seen.append(torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item())

    scale = 2.0 ** 12
    fp16 = Clipped()
    fit(fp16, plugins=[AmpPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=scale))],
        gradient_clip_val=0.5, max_steps=1)
    fp32 = Clipped()
    fit(fp32, max_steps=1)
    ours, reference = seen
    assert abs(ours - reference) <= 2e-2 * reference   # divided by the scale before the hook and clipping
    assert torch.cat([p.grad.flatten() for p in fp16.parameters()]).norm().item() <= 0.5 * 1.001


def test_checkpoint_restores_the_scaler(tmp_path):
    module = Classifier(inf_at_step=0)
    trainer = fit(module, plugins=[AmpPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(
        init_scale=2.0 ** 10, growth_interval=100))])
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["AmpPrecision"]
    assert saved["loss_scale"] == 2.0 ** 9 and saved["clean_steps"] == STEPS - 1

    resumed = AmpPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 4,
                                                                               growth_interval=100))
    trainer = pl.Trainer(**{**TRAINER_SETTINGS, "max_steps": STEPS + 1}, plugins=[resumed])
    trainer.fit(Classifier(), batches(STEPS + 1), ckpt_path=path)
    assert resumed.scaler.get_scale() == 2.0 ** 9
    assert resumed.scaler.clean_steps == STEPS   # restored STEPS - 1, then one clean step


def test_report_html_is_written_at_the_end_of_fit(tmp_path):
    path = tmp_path / "model.html"
    fit(Classifier(), plugins=[AmpPrecision(report_html=str(path))], max_steps=1)
    assert path.exists() and "fc1" in path.read_text()


def test_bad_arguments_and_fsdp_are_refused_with_the_alternative():
    with pytest.raises(ValueError, match="without loss scaling"):
        AmpPrecision(dtype=torch.bfloat16, scaler=amp_compiler.GradScaler())
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        AmpPrecision(dtype=torch.float32)
    with pytest.raises(TypeError, match="LossScaleManager"):
        AmpPrecision(dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="FSDPPrecision"):   # Lightning's FSDP accepts only its own plugin
        FSDPStrategy(precision_plugin=AmpPrecision())


def test_fsdp1_takes_amp_fsdp_precision_with_the_levels_mixed_precision_and_no_autocast():
    """Lightning's FSDPStrategy (FSDP1) accepts only an FSDPPrecision and runs on GPUs only: what runs here is
    the plugin's side (the strategy takes it, FSDP1's MixedPrecision from the level, no autocast, the loss scaled
    once in a fit); FSDP1 training itself is untested."""
    from torch.distributed.fsdp import MixedPrecision
    plugin = AmpFSDPPrecision("O1", dtype=torch.bfloat16)
    strategy = FSDPStrategy(precision_plugin=plugin)
    assert strategy.precision_plugin is plugin
    assert strategy.mixed_precision_config == MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                             buffer_dtype=torch.float32)   # not bf16-mixed's bf16
    assert AmpFSDPPrecision("O3", dtype=torch.float16).mixed_precision_config.param_dtype == torch.float16
    assert AmpFSDPPrecision("O3").mixed_precision_config.reduce_dtype == torch.float32
    with plugin.forward_context():   # FSDPPrecision's would be torch.autocast("cuda")
        assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
    with pytest.raises(Exception, match="GPU"):   # Lightning's own requirement
        pl.Trainer(accelerator="cpu", strategy=FSDPStrategy(precision_plugin=plugin))
    # the plugin's hooks in a fit (one device): the gradients reach on_before_optimizer_step unscaled, once
    seen = []

    class Recorded(Classifier):
        def on_before_optimizer_step(self, optimizer):
            seen.append(torch.cat([p.grad.flatten() for p in self.parameters()]).norm().item())

    fit(Recorded(), plugins=[AmpFSDPPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(
        init_scale=2.0 ** 12))], max_steps=1)
    fit(Recorded(), max_steps=1)
    ours, reference = seen
    assert abs(ours - reference) <= 2e-2 * reference, (ours, reference)   # 4096x off if scaled twice


def test_mp_policy_is_the_levels_fsdp2_mixed_precision_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    assert AmpPrecision("O1").mp_policy == MixedPrecisionPolicy()   # fp32 gathers and reduction
    assert AmpPrecision("O3", dtype=torch.float16).mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float32)
    assert AmpFabricPrecision("O2").mp_policy == MixedPrecisionPolicy()


# -- Fabric ----------------------------------------------------------------------------------------------------
def fabric_losses(plugin_or_precision, inf_at_step=None):
    settings = {"plugins": plugin_or_precision} if isinstance(plugin_or_precision, AmpFabricPrecision) \
        else {"precision": plugin_or_precision}
    fabric = Fabric(accelerator="cpu", devices=1, **settings)
    torch.manual_seed(0)
    model, optimizer = fabric.setup(TinyAttention(), torch.optim.SGD(TinyAttention().parameters(), lr=0.1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, changed = [], []
    for step, (x, y) in enumerate(batches()):
        if step == inf_at_step:
            x[0, 0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return losses, changed, model, fabric


def test_fabric_bf16_trains_like_bf16_mixed(amp_log):
    reference, *_ = fabric_losses("bf16-mixed")
    losses, changed, model, _ = fabric_losses(AmpFabricPrecision("O1", dtype=torch.bfloat16))
    for ours, theirs in zip(losses, reference):
        assert abs(ours - theirs) <= 2e-2 * abs(theirs), (losses, reference)
    assert all(changed)
    report = str(amp_compiler.explain(model.module))
    assert "torch.dynamo: 1 graph(s)" in report   # the default capture
    assert sum("amp-compiler report" in r.getMessage() for r in amp_log) == 1


def test_fabric_fp16_skips_the_inf_step_and_checkpoints_the_scaler(amp_log, tmp_path):
    plugin = AmpFabricPrecision("O1", dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 10))
    _, changed, _, fabric = fabric_losses(plugin, inf_at_step=1)
    assert changed == [True, False, True]
    assert plugin.scaler.get_scale() == 2.0 ** 9
    assert sum("step skipped" in r.getMessage() for r in amp_log) == 1
    assert plugin.scaler.last_overflow_report.forward["found"] == "model input"   # the forward replayed
    # Fabric saves no precision state by itself: the plugin goes into the user's state like any stateful object
    fabric.save(tmp_path / "run.ckpt", {"amp": plugin})
    fresh = AmpFabricPrecision(dtype=torch.float16)
    fabric.load(tmp_path / "run.ckpt", {"amp": fresh})
    assert fresh.scaler.get_scale() == 2.0 ** 9 and fresh.scaler.state_dict() == plugin.scaler.state_dict()


# -- ddp_spawn -------------------------------------------------------------------------------------------------
class RankRecorder(pl.Callback):
    """Each rank writes what it saw (spawned ranks' modules do not come back to the test)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def on_train_end(self, trainer, module):
        with open(f"{self.folder}/rank{trainer.global_rank}.json", "w") as file:
            json.dump({"changed": module.params_changed, "scales": module.scales,
                       "report": str(trainer.precision_plugin.scaler.last_overflow_report)}, file)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_spawn_one_ranks_inf_skips_the_step_on_both(tmp_path, monkeypatch):
    # Spawned ranks unpickle Lightning before anything else: on this CPU torch, torchvision's op schemas must be
    # defined first (models/torchvision_ops.py, a no-op where torchvision's extension loads): a sitecustomize does
    (tmp_path / "sitecustomize.py").write_text("import amp_compiler.models.torchvision_ops\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    # a port free now (Lightning reuses the one an earlier run in this process chose: EADDRINUSE in CI)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    module = Classifier(inf_at_step=1, inf_on_rank=1)
    plugin = AmpPrecision(dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 10))
    fit(module, plugins=[plugin], strategy="ddp_spawn", devices=2, callbacks=[RankRecorder(tmp_path)])
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["changed"] == [True, False, True], (rank, seen)
        assert seen["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], (rank, seen)
        # each rank replayed the skipped step on its own batch: only rank 1's holds the inf (under DDP the
        # LightningModule is called, so the report says its own code passed the inf to 'model')
        assert ("before calling 'model') became inf" in seen["report"]) == (rank == 1), (rank, seen)
        assert (seen["report"] == "None") == (rank == 0), (rank, seen)
