"""AmpPrecision under Lightning's ModelParallelStrategy (FSDP2) on 2 gloo CPU ranks, launched as Lightning users
launch it: `python tests/lightning_model_parallel_job.py OUT` (Trainer(accelerator="cpu", devices=2,
strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)); Lightning's subprocess launcher
starts rank 1). The LightningModule shards its blocks and its root with fully_shard in configure_model.

One launch runs every configuration in sequence (~12 s on an idle 2-core machine); this module's tests read what
each rank wrote: Lightning's own bf16-mixed, O1 bf16, O3 bf16 (low gathers), O2 fp16 with gradient accumulation,
O1 fp16 with an inf on rank 1 and a distributed checkpoint resumed, fp8 delayed scaling resumed, and the
refusals (a MixedPrecisionPolicy against the level's, tensor parallelism). The references are computed here in
one process: the same model converted in place, trained on the global batch."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import amp_compiler
from lightning_model_parallel_job import BATCH, RANKS, BlockNet, batches

pytestmark = pytest.mark.distributed

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_model_parallel_job.py")
TOLERANCE = 0.05   # of how far training moved each tensor (measured: 0.56% from Lightning's bf16-mixed at O1)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_parallel")
    with socket.socket() as sock:   # a port free now (Lightning's own pick can collide with another run's)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("LOCAL_RANK", None)   # Lightning launches rank 1 itself only where no launcher set ranks
    done = subprocess.run([sys.executable, JOB, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    def seen(name: str, rank: int = 0) -> dict:
        return json.loads((out / f"{name}.rank{rank}.json").read_text())
    return seen


def parameters(seen: dict) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in seen["parameters"].items()}


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"model.{name}": p.detach().clone() for name, p in BlockNet().named_parameters()}


def assert_close_to(ours: dict, reference: dict, what: str) -> None:
    start = initial()
    for name, theirs in reference.items():
        moved, off = (theirs - start[name]).norm(), (ours[name] - theirs).norm()
        assert off <= TOLERANCE * moved, f"{name}: {off:.3g} from {what}, which moved it {moved:.3g}"


def global_batches():
    """Both ranks' batches, step by step, epoch after epoch, as Lightning deals them: its DistributedSampler
    shuffles a training set (seed 0, set_epoch each epoch); each rank's mean loss over equal batches, averaged
    by FSDP's gradient reduction, is the mean over the two."""
    dataset = batches().dataset
    for epoch in range(100):
        per_rank = []
        for rank in range(RANKS):
            sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=RANKS, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for start in range(0, len(per_rank[0]), BATCH):
            yield dataset[[i for indices in per_rank for i in indices[start:start + BATCH]]]


def one_process(level: str, dtype: torch.dtype, steps: int, accumulated: int = 1) -> dict[str, torch.Tensor]:
    """The same model converted in place in one process, SGD on the global batch (global_batches), Lightning's
    loss division under accumulation, amp_compiler's scaler for fp16."""
    torch.manual_seed(0)
    model = amp_compiler.convert(BlockNet(), level, dtype=dtype, inplace=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp_compiler.GradScaler(init_scale=2.0 ** 10) if dtype == torch.float16 else None
    micro = global_batches()
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulated):
            x, y = next(micro)
            loss = F.cross_entropy(model(x).float(), y) / accumulated
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return {f"model.{name}": p.detach() for name, p in model.named_parameters()}


def test_o1_bf16_trains_sharded_like_bf16_mixed_and_one_process_with_every_linear_low(job):
    ours = job("o1_bf16")
    assert all(ours["changed"])
    assert_close_to(parameters(ours), parameters(job("lightning_bf16")), "Lightning's bf16-mixed on the same ranks")
    assert_close_to(parameters(ours), one_process("O1", torch.bfloat16, steps=4), "one process on the global batch")
    # compiled per block (configure_model sharded before convert_module): every linear's graph low, each block's own
    assert ours["linears"] == {path: "bfloat16" for path in ("model.embed", "model.blocks.0.fc", "model.blocks.1.fc",
                                                             "model.head")}
    assert any("compiled per block" in note and "sharded with FSDP2" in note for note in ours["notes"])
    assert sum("graph " in note for note in ours["notes"]) == 4   # embed, the two blocks, head
    assert ours["warnings"] == []
    for rank in range(RANKS):   # both ranks hold the same full parameters
        assert job("o1_bf16", rank)["parameters"] == ours["parameters"]


def test_o3_gathers_low_with_the_plugins_policy_and_trains_unwarned(job):
    for rank in range(RANKS):
        seen = job("o3_bf16", rank)
        assert all(seen["changed"]) and all(torch.isfinite(torch.tensor(seen["losses"])))
        assert seen["warnings"] == [], seen["warnings"]   # FSDP2's bf16 gathers are no model.half()
        assert set(seen["linears"].values()) == {"bfloat16"}


def test_o2_fp16_with_gradient_accumulation_steps_every_second_batch_like_one_process(job):
    ours = job("o2_fp16_accumulated")
    assert ours["changed"] == [False, True, False, True] and ours["scales"] == [2.0 ** 10] * 4
    assert set(ours["linears"].values()) == {"float16"}
    assert_close_to(parameters(ours), one_process("O2", torch.float16, steps=2, accumulated=2),
                    "one process on the global batch")


def test_one_ranks_inf_skips_the_step_on_both_and_that_rank_says_where(job):
    for rank in range(RANKS):
        seen = job("o1_fp16_overflow", rank)
        assert seen["changed"] == [True, False, True, True], (rank, seen["changed"])
        assert seen["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 9], (rank, seen["scales"])
        skipped = [line for line in seen["log"] if "step skipped" in line]
        assert len(skipped) == 1 and f"on rank {rank}" in skipped[0], (rank, seen["log"])
        if rank == 1:   # the rank that holds the inf names where (here: the batch it was given)
            assert "was inf already (model input" in skipped[0] and "model" in seen["overflow_report"]
        else:           # the other's replay stayed finite: no report pointing at the gradients FSDP brought it
            assert "stayed finite on this rank" in skipped[0] and "FSDP's gradient reduction" in skipped[0]
            assert seen["overflow_report"] == "None"


def test_sharded_checkpoint_resumes_the_scaler_and_ends_where_the_uninterrupted_run_ends(job):
    for rank in range(RANKS):
        uninterrupted, resumed = job("o1_fp16_overflow", rank), job("o1_fp16_resumed", rank)
        # the resumed plugin started at 2**4: the checkpoint's 2**9 (halved at the skipped step) and count came back
        assert resumed["scales"] == [2.0 ** 9, 2.0 ** 9] and resumed["scaler"] == uninterrupted["scaler"]
        assert resumed["parameters"] == uninterrupted["parameters"], rank


def test_fp8_delayed_histories_survive_the_distributed_checkpoint_each_ranks_own(job):
    ranks = [(job("fp8_delayed", rank), job("fp8_delayed_resumed", rank)) for rank in range(RANKS)]
    for rank, (uninterrupted, resumed) in enumerate(ranks):
        assert len(uninterrupted["histories"]) == 9   # x, w, grad of the three 16x16 linears (the head's N is 4)
        assert resumed["histories"] == uninterrupted["histories"], rank
        assert resumed["parameters"] == uninterrupted["parameters"], rank
    # each rank recorded its own batches' amaxes: rank 1 resuming from rank 0's would not end where it did
    assert ranks[0][0]["histories"] != ranks[1][0]["histories"]


def test_a_policy_against_the_level_and_tensor_parallelism_are_refused_naming_the_fix(job):
    for rank in range(RANKS):
        refused = job("refusals", rank)
        assert "gathers the weights in torch.bfloat16, but level O1 keeps some of them fp32" in \
            refused["low_gathers_at_o1"] and "mp_policy=self.trainer.precision_plugin.mp_policy" in \
            refused["low_gathers_at_o1"]
        assert "reduces gradients in float16" in refused["fp16_reduction"]
        assert "model.head.weight is a DTensor" in refused["tensor_parallel"] and \
            "tensor_parallel_size=1" in refused["tensor_parallel"]
