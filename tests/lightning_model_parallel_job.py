"""Launched by tests/integrations/test_lightning_model_parallel.py as a Lightning user launches: `python
tests/lightning_model_parallel_job.py OUT`, with Trainer(accelerator="cpu", devices=2,
strategy=ModelParallelStrategy(...)); Lightning's subprocess launcher starts rank 1 (this script again).

The LightningModule shards its blocks and the root in configure_model with fully_shard, as Lightning's FSDP2 docs
do. Several configurations run in sequence in this one job (each a Trainer.fit on the same two ranks); each rank
writes OUT/<configuration>.rank<r>.json with what it saw: the full parameters, the low linears of explain(),
whether each step moved the parameters, the loss scale, the plugin's log lines, fp8 histories. The test compares.
Not collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import amp_compiler.models.torchvision_ops  # noqa: F401 - this CPU torch: torchvision's op schemas before Lightning

import json
import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import amp_compiler
from amp_compiler.dynamo.compile import history_stores
from amp_compiler.lightning import AmpPrecision

WIDTH, CLASSES, EXAMPLES, BATCH, RANKS = 16, 4, 16, 4, 2   # an epoch: 2 steps of 4 examples per rank on 2 ranks
SETTINGS = dict(accelerator="cpu", devices=RANKS, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x))) + x


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, CLASSES)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Sharded(pl.LightningModule):
    """training_step calls self.model; configure_model shards each block, then the root, over the data-parallel
    mesh with the plugin's MixedPrecisionPolicy (Lightning's own precision: FSDP2's default)."""

    def __init__(self, inf_at_step: int | None = None, inf_on_rank: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.model = BlockNet()
        self.inf_at_step, self.inf_on_rank = inf_at_step, inf_on_rank
        self.changed, self.scales, self.losses = [], [], []

    def configure_model(self):
        if isinstance(self.model.blocks[0], torch.distributed.fsdp.FSDPModule):
            return   # a second fit
        plugin = self.trainer.precision_plugin
        policy = plugin.mp_policy if isinstance(plugin, AmpPrecision) else MixedPrecisionPolicy()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.inf_at_step and self.global_rank == self.inf_on_rank:
            x = x.clone()
            x[0, 0] = float("inf")
        loss = F.cross_entropy(self.model(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self._before = [p.detach().to_local().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.changed.append(any(not torch.equal(a, p.detach().to_local()) for a, p in zip(self._before,
                                                                                          self.parameters())))
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if isinstance(scaler, amp_compiler.GradScaler) else None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(EXAMPLES, WIDTH, generator=generator)
    y = torch.randint(0, CLASSES, (EXAMPLES,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class PluginLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        logging.getLogger("lightning.pytorch.amp_compiler").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


def run(name: str, out: str, module: Sharded, steps: int = 4, ckpt_path=None, **settings) -> None:
    log = PluginLog()
    trainer = pl.Trainer(**{**SETTINGS, "max_steps": steps, **settings})
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(module, batches(), ckpt_path=ckpt_path)
    logging.getLogger("lightning.pytorch.amp_compiler").removeHandler(log)
    full = {n: p.detach().full_tensor().tolist() for n, p in module.named_parameters()}   # collective: both ranks
    plugin = trainer.precision_plugin
    seen = {"parameters": full, "changed": module.changed, "scales": module.scales, "log": log.lines,
            "losses": module.losses, "warnings": [str(w.message) for w in warned if "amp_compiler" in str(w.message)]}
    if isinstance(plugin, AmpPrecision):
        report = amp_compiler.explain(module)
        seen["linears"] = {row["module"]: row["dtype"] for row in report.rows if row["op"] == "linear"}
        seen["notes"] = report.summary["notes"]
        seen["overflow_report"] = str(plugin.scaler.last_overflow_report) if plugin.scaler is not None else None
        seen["histories"] = {f"{prefix}{key}.{part}": tensor.tolist() for prefix, store in history_stores(module)
                             for key, tensors in store.tensors.items() for part, tensor in tensors.items()}
        seen["scaler"] = plugin.scaler.state_dict() if plugin.scaler is not None else None
    with open(os.path.join(out, f"{name}.rank{trainer.global_rank}.json"), "w") as file:
        json.dump(seen, file)


def refusals(out: str) -> None:
    """What convert_module refuses, called as ModelParallelStrategy calls it (after configure_model), outside a
    Trainer: an exception inside fit would make Lightning's launcher kill the other rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (RANKS,))
    refused = {}
    cases = {
        "low_gathers_at_o1": ("O1", lambda m: fully_shard(m.model.blocks[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
        "fp16_reduction": ("O3", lambda m: fully_shard(m.model.blocks[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float16))),
        "tensor_parallel": ("O1", lambda m: parallelize_module(m.model.head, mesh, ColwiseParallel())),
    }
    for name, (level, shard) in cases.items():
        module = Sharded()
        shard(module)
        try:
            AmpPrecision(level, dtype=torch.float16).convert_module(module)
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
    with open(os.path.join(out, f"refusals.rank{torch.distributed.get_rank()}.json"), "w") as file:
        json.dump(refused, file)


def strategy():
    return ModelParallelStrategy(data_parallel_size=RANKS, tensor_parallel_size=1)


def main(out: str) -> None:
    torch.set_num_threads(1)
    fp16 = dict(dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 10, growth_interval=100))
    run("lightning_bf16", out, Sharded(), strategy=strategy(), precision="bf16-mixed")
    run("o1_bf16", out, Sharded(), strategy=strategy(), plugins=[AmpPrecision("O1", dtype=torch.bfloat16)])
    # O3 gathers the parameters low (plugin.mp_policy: bf16 gathers, fp32 reduction)
    run("o3_bf16", out, Sharded(), strategy=strategy(), plugins=[AmpPrecision("O3", dtype=torch.bfloat16)])
    run("o2_fp16_accumulated", out, Sharded(), steps=2, accumulate_grad_batches=2, strategy=strategy(),
        plugins=[AmpPrecision("O2", **fp16)])
    # one rank's inf at step 1, a distributed checkpoint at step 2, then a resumed run to step 4
    folder = os.path.join(out, "checkpoints")
    saving = ModelCheckpoint(dirpath=folder, filename="fp16-{step}", every_n_train_steps=2, save_top_k=-1)
    run("o1_fp16_overflow", out, Sharded(inf_at_step=1), strategy=strategy(), enable_checkpointing=True,
        callbacks=[saving], plugins=[AmpPrecision("O1", **fp16)])
    run("o1_fp16_resumed", out, Sharded(), strategy=strategy(), ckpt_path=os.path.join(folder, "fp16-step=2.ckpt"),
        plugins=[AmpPrecision("O1", dtype=torch.float16, scaler=amp_compiler.GradScaler(init_scale=2.0 ** 4))])
    fp8 = dict(fp8_min_dim=16, fp8_scaling="delayed", fp8_history=4)
    saving = ModelCheckpoint(dirpath=folder, filename="fp8-{step}", every_n_train_steps=2, save_top_k=-1)
    run("fp8_delayed", out, Sharded(), strategy=strategy(), enable_checkpointing=True, callbacks=[saving],
        plugins=[AmpPrecision("fp8", **fp8)])
    run("fp8_delayed_resumed", out, Sharded(), strategy=strategy(), ckpt_path=os.path.join(folder, "fp8-step=2.ckpt"),
        plugins=[AmpPrecision("fp8", **fp8)])
    refusals(out)


if __name__ == "__main__":
    main(sys.argv[1])
