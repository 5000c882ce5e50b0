"""Level "fp8" where users switch to it in one line: convert(model, "fp8", inplace=True), Hugging Face generate()
on a model converted in place, Lightning's AmpPrecision, the HF AmpTrainer / AmpCallback and
amp_compiler.accelerate.prepare, at fp8_scaling "current" and "delayed" (fp8_min_dim=16: the tiny models'
matmuls qualify; every K and N a multiple of 16).

Each integration trains a few steps, its loss goes down and ends near the fp32 run's, and its graphs hold fp8
matmuls (fp8_scaled_linear nodes, explain()'s "fp8 (" rules), not just bf16 ones. At "delayed" the amax
histories are in the user's model's state_dict (dynamo/fp8_histories.py), survive each framework's checkpoint
(a resumed run ends bit for bit where the uninterrupted one does) and are not written by validation/eval loops.
"""
from __future__ import annotations

import contextlib
import inspect

import amp_compiler.models.torchvision_ops  # noqa: F401 - before transformers/lightning (torchvision's ops)
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import amp_compiler
from amp_compiler.dynamo.compile import compiled_graphs
from amp_compiler.dynamo.fp8_histories import STATE_NAME
from amp_testing import one_torch_thread

SCALINGS = ("current", "delayed")
FP8 = dict(fp8_min_dim=16)


def fp8_options(scaling: str, capture: str | None = None) -> dict:
    return {**FP8, "fp8_scaling": scaling, **({"fp8_history": 4} if scaling == "delayed" else {}),
            **({"capture": capture} if capture else {})}


# both recipes (in place: on TorchDynamo's capture, named explicitly or by default)
SCALINGS_AND_CAPTURES = [("current", "dynamo"), ("delayed", "dynamo")]
WIDTH, CLASSES, BATCH = 32, 16, 8


@pytest.fixture(autouse=True)
def one_thread():
    with one_torch_thread():   # tiny matmuls: bit-identical runs, no thread pool contention on 2 cores
        yield


class Mlp(nn.Module):
    """Three Linears whose K and N are multiples of 16: all lowered at fp8_min_dim=16. Returns a dict with the
    loss when given labels (what HF's Trainer and Accelerate loops read)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.head = nn.Linear(WIDTH, 64), nn.Linear(64, 64), nn.Linear(64, CLASSES)

    def forward(self, x, labels=None):
        logits = self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))
        return {"logits": logits} if labels is None else {"loss": F.cross_entropy(logits.float(), labels),
                                                          "logits": logits}


def task(count: int, seed: int = 1) -> list[dict]:
    """Labels a fixed projection of x picks: learnable in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, WIDTH, generator=generator) * 2
    teacher = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(99))
    return [{"x": row, "labels": label} for row, label in zip(x, (x @ teacher).argmax(-1))]


def batches(count: int, seed: int = 1) -> list[dict]:
    rows = task(count * BATCH, seed)
    return [{"x": torch.stack([r["x"] for r in rows[i:i + BATCH]]),
             "labels": torch.stack([r["labels"] for r in rows[i:i + BATCH]])} for i in range(0, len(rows), BATCH)]


def epochs(count: int = 4) -> list[dict]:
    """Two batches, `count` epochs: a tiny MLP learns them in 8 SGD steps (fp32 loss 2.8 -> 0.4-0.8)."""
    return batches(2) * count


def train(model: nn.Module, data: list[dict], optimizer) -> list[float]:
    losses = []
    for batch in data:
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def fp32_losses(data: list[dict]) -> list[float]:
    model = Mlp()
    return train(model, data, torch.optim.SGD(model.parameters(), lr=0.5))


def converted_graphs(model: nn.Module) -> list:
    """The graphs the in-place conversion made so far (every graph dynamo made, compiled children's too)."""
    return [gm for _, gm, _ in compiled_graphs(model)]


def fp8_matmuls(model: nn.Module) -> int:
    """fp8 matmul nodes in the graphs the in-place conversion captured so far."""
    graph_modules = converted_graphs(model)
    assert graph_modules, "not converted in place"
    return sum(fp8_matmuls_in(gm) for gm in graph_modules)


def fp8_matmuls_in(gm) -> int:
    return sum(1 for node in gm.graph.nodes
               if getattr(node.target, "__name__", "") in ("fp8_scaled_linear", "fp8_scaled_matmul"))


def assert_fp8_lowered(model: nn.Module, at_least: int) -> None:
    rows = [row for row in amp_compiler.explain(model, op="linear").rows if row["rule"].startswith("fp8 (")]
    assert fp8_matmuls(model) >= at_least and len(rows) >= at_least, \
        f"{fp8_matmuls(model)} fp8 matmul nodes, {len(rows)} explain() rows 'fp8 (...)'; expected {at_least}"


def histories(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if STATE_NAME in k}


def assert_went_down(losses: list[float]) -> None:
    """The last epoch's mean loss (2 batches) well below the first's."""
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2]), f"loss did not go down: {losses}"


def assert_trained_like_fp32(losses: list[float], reference: list[float]) -> None:
    assert_went_down(losses)
    gap = abs(sum(losses[-2:]) - sum(reference[-2:])) / 2
    assert gap <= 0.1 * reference[0], f"fp8 {losses} vs fp32 {reference}"


# -- 1. in place -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling, capture", SCALINGS_AND_CAPTURES)
def test_in_place_keeps_the_object_and_trains_in_fp8(scaling, capture):
    model = Mlp()
    signature = inspect.signature(model.forward)
    assert amp_compiler.convert(model, "fp8", inplace=True, fp8_scaling=scaling, capture=capture, **FP8) is model
    assert type(model) is Mlp and inspect.signature(model.forward) == signature
    data = epochs()
    losses = train(model, data, torch.optim.SGD(model.parameters(), lr=0.5))
    assert_fp8_lowered(model, 3)
    assert_trained_like_fp32(losses, fp32_losses(data))
    weights = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"}
    keys = set(model.state_dict())
    if scaling == "current":
        assert keys == weights
    else:   # one x/w/grad history per matmul, under its module's path
        assert keys == weights | {f"{m}.{STATE_NAME}.{h}" for m in ("fc1", "fc2", "head") for h in ("x", "w", "grad")}
        assert all(v[:len(data)].gt(0).all() and not v[len(data):].any() for v in histories(model).values())


def test_delayed_histories_load_back_before_any_call_and_the_resumed_run_is_the_uninterrupted_one():
    """A checkpoint of model.state_dict() loaded into a freshly converted model (no graph captured yet): the
    graphs captured later start from the loaded histories, so the next scales, and every later step, are the
    uninterrupted run's. Without them the resumed run rescales from scratch (differs)."""
    data = batches(6)
    data[3] = {"x": data[3]["x"] * 0.05, "labels": data[3]["labels"]}   # the first step after resuming: its own
    runs = {}                                                           # amax is far below the history's
    for resumed in (False, True, "histories dropped"):
        model = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4, **FP8)
        train(model, data[:3], torch.optim.SGD(model.parameters(), lr=0.5))
        if resumed:
            saved = {k: v.clone() for k, v in model.state_dict().items()
                     if resumed is True or STATE_NAME not in k}
            model = amp_compiler.convert(Mlp(seed=7), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4,
                                         **FP8)
            model.load_state_dict(saved, strict=False)
        train(model, data[3:], torch.optim.SGD(model.parameters(), lr=0.5))   # plain SGD: no optimizer state
        runs[resumed] = model.state_dict()
    assert runs[False].keys() == runs[True].keys()
    assert all(torch.equal(runs[False][k], runs[True][k]) for k in runs[False])
    assert not all(torch.equal(runs[False][k], runs["histories dropped"][k]) for k in runs[False])


def test_the_example_inputs_capture_call_records_no_amax():
    """convert(..., inplace=True, example_inputs=...) captures with one call whose effects are undone: its amax
    must not be the first entry training's delayed scales come from (the call looked like a training step)."""
    data = batches(1)
    model = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed",
                                 example_inputs=(data[0]["x"] * 1000,), **FP8)
    assert fp8_matmuls(model) == 3   # captured by that call
    recorded = histories(model)
    assert recorded and not any(v.any() for v in recorded.values()), recorded


def test_delayed_histories_loaded_strictly_name_what_is_missing_or_does_not_fit():
    model = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4, **FP8)
    train(model, batches(1), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=f"Missing key.*fc1.{STATE_NAME}.x"):
        model.load_state_dict(Mlp().state_dict())   # a plain checkpoint: the histories would silently stay
    longer = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=8, **FP8)
    train(longer, batches(1), torch.optim.SGD(longer.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="4 calls in the checkpoint, 8 in this conversion"):
        longer.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match=f"Unexpected key.*{STATE_NAME}"):
        Mlp().load_state_dict(model.state_dict())   # an unconverted model: strict=False, or drop the keys
    amp_compiler.restore(model)
    assert STATE_NAME not in "".join(model.state_dict())


def test_delayed_eval_graph_reads_the_training_histories_and_records_nothing():
    """In place, model.eval() captures a graph of its own: it holds the training graph's history tensors
    (it read an empty history of its own before) and does not write them."""
    model = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", **FP8)
    train(model, batches(2), torch.optim.SGD(model.parameters(), lr=0.1))
    before = histories(model)
    model.eval()
    with torch.no_grad():
        model(batches(1, seed=5)[0]["x"] * 100)
    assert len(converted_graphs(model)) == 2
    after = histories(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    train_gm, eval_gm = converted_graphs(model)
    assert eval_gm.fp8_history.linear.x is train_gm.fp8_history.linear.x and not eval_gm.fp8_history.linear.training


class TrainingOnlyMatmul(nn.Module):
    """Two matmuls of one module (F.linear of its own parameters); the first runs in training mode only, so the
    training and eval graphs hold different matmuls of one module path. The tiny `aux` weight's amax is ~1000x
    below `main`'s: one's history scaling the other saturates every e4m3 value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.aux = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.01)
        self.main = nn.Parameter(torch.randn(WIDTH, WIDTH) * 10)

    def forward(self, x):
        if self.training:
            x = x + F.linear(x, self.aux)
        return F.linear(x, self.main)


def test_delayed_histories_of_one_modules_matmuls_follow_their_weights_not_the_graph_order():
    """The eval graph's only matmul is the training graph's second: keyed by graph order (_amp_fp8_history,
    _1) it read aux's history and scaled main's weight from aux's amax (eval output 0.996 relative error: every
    value saturated); keyed by the weight it reads, its own (0.04, fp8's error)."""
    model = amp_compiler.convert(TrainingOnlyMatmul(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4,
                                 **FP8)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(3))
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        out = model(x).float()
    expected = F.linear(x, model.main)
    assert fp8_matmuls(model) == 3   # 2 in the training graph, 1 in the eval graph
    error = ((out - expected).norm() / expected.norm()).item()
    assert error < 0.1, f"eval output {error:.3f} from fp32"
    assert set(histories(model)) == {f"{STATE_NAME}_{w}.{h}" for w in ("aux", "main") for h in ("x", "w", "grad")}


class LinearCalledTwice(nn.Module):
    """One Linear called twice in training (first on inputs 1000x smaller), once in eval."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        if self.training:
            x = self.fc(x * 1e-3) * 1e-3
        return self.fc(x * 100)


def test_delayed_histories_of_one_weight_called_a_different_number_of_times_are_not_paired():
    """The training graph calls fc twice, the eval graph once: paired by graph order, the eval call read the
    training graph's first call's history (x amax 0.004 for its 370) and saturated: output 1.00 relative error.
    The repeated calls' histories are _<i>of<n> now; the eval graph's one call shares none of them."""
    model = amp_compiler.convert(LinearCalledTwice(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4,
                                 **FP8)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(3))
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        out, expected = model(x).float(), model.fc(x * 100)
    error = ((out - expected).norm() / expected.norm()).item()
    assert error < 0.1, f"eval output {error:.3f} from fp32"
    assert {k.rsplit(".", 1)[0] for k in histories(model)} == \
        {f"fc.{STATE_NAME}", f"fc.{STATE_NAME}_0of2", f"fc.{STATE_NAME}_1of2"}


def test_delayed_histories_of_another_length_are_refused_before_any_capture_too():
    """A checkpoint of fp8_history=4 loaded into a fresh fp8_history=8 conversion (no graph yet): the load said
    'All keys matched', then every capture refused the loaded histories and the model ran as written, in fp32,
    with no word. Now the load fails as it does after a capture, strict or not."""
    saved = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=4, **FP8)
    train(saved, batches(1), torch.optim.SGD(saved.parameters(), lr=0.1))
    for strict in (True, False):
        fresh = amp_compiler.convert(Mlp(), "fp8", inplace=True, fp8_scaling="delayed", fp8_history=8, **FP8)
        with pytest.raises(RuntimeError, match=f"fc1.{STATE_NAME}.x: 4 calls in the checkpoint, 8 in this conv"):
            fresh.load_state_dict(saved.state_dict(), strict=strict)


# -- 2. Hugging Face generate() --------------------------------------------------------------------------------
SPECIAL = dict(vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        attn_implementation="eager", **SPECIAL))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager", **SPECIAL))


class ForceTokens(transformers.LogitsProcessor):
    """Every step picks the fp32 model's token: both models' logits are compared on the same steps."""

    def __init__(self, sequences):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("-inf")).scatter_(
            1, self.sequences[:, input_ids.shape[1]:input_ids.shape[1] + 1], 0.0)


def generate(model, along=None):
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    processors = transformers.LogitsProcessorList([ForceTokens(along)] if along is not None else [])
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              logits_processor=processors, output_logits=True, return_dict_in_generate=True)


@pytest.mark.real_models
@pytest.mark.parametrize("scaling, capture", SCALINGS_AND_CAPTURES)
@pytest.mark.parametrize("build, lowered", [(_llama, 15), (_gpt2, 9)], ids=["llama", "gpt2"])
def test_generate_at_fp8_keeps_the_model_and_its_logits_are_within_fp8s_error(build, lowered, scaling, capture):
    """Along the fp32 model's tokens (free-running greedy tokens of a random-init model diverge at the first
    near tie), per-step logits within 0.1 of the logit scale (measured 0.03-0.07 of it; O1 bf16: 0.005)."""
    torch.manual_seed(0)
    fp32_model = build().eval()
    model = build().eval()
    model.load_state_dict(fp32_model.state_dict())
    cls = type(model)
    amp_compiler.convert(model, "fp8", inplace=True, fp8_scaling=scaling, capture=capture, **FP8)
    expected = generate(fp32_model)
    ours = generate(model, along=expected.sequences)
    assert type(model) is cls and torch.equal(ours.sequences, expected.sequences)
    scale = max(step.abs().max().item() for step in expected.logits)
    error = max((a - b).abs().max().item() for a, b in zip(ours.logits, expected.logits, strict=True))
    assert 0 < error <= 0.1 * scale, f"max logit error {error:.3g} vs logit scale {scale:.3g}"
    # the prefill graph and each decode graph run all of them fp8: q/k/v/o (GPT-2: c_attn/c_proj), MLPs, lm_head
    graph_counts = [fp8_matmuls_in(gm) for _, gm, _ in compiled_graphs(model)]
    assert len(graph_counts) >= 2 and set(graph_counts) == {lowered}, graph_counts
    if scaling == "delayed":   # eval: generate records nothing
        assert histories(model) and not any(v.any() for v in histories(model).values())


@pytest.mark.real_models
def test_generate_after_training_reads_the_training_histories_and_records_nothing():
    """A training call with labels makes the training graph, generate() its prefill and decode graphs: all key each
    matmul's histories by its module path, so the decode graphs hold the training graph's tensors (no new key)
    and, in eval mode, leave them as they were."""
    torch.manual_seed(0)
    model = amp_compiler.convert(_llama(), "fp8", inplace=True, **fp8_options("delayed"))
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids, use_cache=False).loss.backward()
    trained = histories(model)
    assert fp8_matmuls(model) == 15 and len(trained) == 45
    assert all(v[0] > 0 and not v[1:].any() for v in trained.values())   # one training call recorded
    generate(model.eval())
    assert len(converted_graphs(model)) > 2 and fp8_matmuls(model) == 15 * len(converted_graphs(model))
    assert histories(model).keys() == trained.keys()
    assert all(torch.equal(trained[k], v) for k, v in histories(model).items())


# -- 3. Lightning ------------------------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")
from amp_compiler.lightning import FP8_HISTORIES, AmpPrecision  # noqa: E402 - after the importorskip


class LitMlp(pl.LightningModule):
    """training_step calls self.model (the plugin compiles the LightningModule's children)."""

    def __init__(self):
        super().__init__()
        self.model = Mlp()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)["loss"]
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ValidationWatch(pl.Callback):
    """The histories right before and after each validation loop (sanity check included)."""

    def __init__(self):
        self.changed, self.loops = [], 0

    def on_validation_start(self, trainer, module):
        self.before = histories(module)

    def on_validation_end(self, trainer, module):
        self.loops += 1
        after = histories(module)
        # a history first captured here (the sanity check's eval graph) must still be all zero
        self.changed.append(any(not torch.equal(self.before.get(k, torch.zeros_like(v)), v) for k, v in after.items()))


def lightning_fit(module, steps: int, scaling: str, ckpt_path=None, validate: bool = True, callbacks=(),
                  capture: str | None = None):
    watch = ValidationWatch()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
                         num_sanity_val_steps=1 if validate else 0, limit_val_batches=1 if validate else 0,
                         callbacks=[watch, *callbacks],
                         plugins=[AmpPrecision("fp8", **fp8_options(scaling, capture))])
    def loader(data):   # already batched
        return torch.utils.data.DataLoader(data, batch_size=None)
    # 2 batches an epoch: a resume at step 4 starts an epoch, as the uninterrupted run does there
    trainer.fit(module, loader(batches(2)), loader(batches(1, seed=3)) if validate else None, ckpt_path=ckpt_path)
    return trainer, watch


@pytest.mark.parametrize("scaling, capture", SCALINGS_AND_CAPTURES)
def test_lightning_plugin_trains_in_fp8(scaling, capture):
    module = LitMlp()
    _, watch = lightning_fit(module, 8, scaling, capture=capture)
    assert_fp8_lowered(module, 3)
    assert_trained_like_fp32(module.losses, fp32_losses(epochs()))
    assert watch.loops >= 3 and not any(watch.changed)   # sanity check + validations: nothing recorded
    if scaling == "delayed":
        assert histories(module)["model.fc1._amp_fp8_history.x"][:4].gt(0).all()


class TrainStartWatch(pl.Callback):
    def on_train_start(self, trainer, module):
        self.histories = histories(module)


def test_lightning_checkpoint_keeps_the_delayed_histories_and_resumes_on_the_same_scales(tmp_path):
    """The resumed run's first step is the uninterrupted run's 5th bit for bit (its scales come from the saved
    histories; the batches after it differ: Lightning's resume at an epoch end replays the data in another order,
    at fp8_scaling="current" too). A checkpoint without the histories resumes with a warning."""
    straight = LitMlp()
    lightning_fit(straight, 8, "delayed", validate=False)
    first = LitMlp()
    trainer, _ = lightning_fit(first, 4, "delayed", validate=False)
    path = tmp_path / "step4.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    # beside "state_dict": Lightning loads that into the model before the plugin converts it (no such keys yet)
    assert not any(STATE_NAME in k for k in saved["state_dict"]) and len(histories(first)) == 9
    assert all(torch.equal(saved[FP8_HISTORIES][k], v) for k, v in histories(first).items())
    assert type(first).load_from_checkpoint(path).model.fc1.weight.dtype == torch.float32   # a plain load works
    firsts = {}
    for dropped in (False, True):
        if dropped:
            del saved[FP8_HISTORIES]
            torch.save(saved, path)
        resumed, watch = LitMlp(), TrainStartWatch()
        with pytest.warns(UserWarning, match="restart empty") if dropped else contextlib.nullcontext():
            lightning_fit(resumed, 5, "delayed", ckpt_path=path, validate=False, callbacks=[watch])
        firsts[dropped] = resumed.losses[0]
        if not dropped:
            assert watch.histories.keys() == histories(first).keys()
            assert all(torch.equal(watch.histories[k], v) for k, v in histories(first).items())
    assert firsts[False] == straight.losses[4] != firsts[True]


# -- 4. Hugging Face Trainer --------------------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def trainer_arguments(output_dir, **overrides):
    settings = dict(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=BATCH,
                    per_device_eval_batch_size=BATCH, max_steps=8, optim="sgd", learning_rate=0.5,
                    lr_scheduler_type="constant", save_strategy="no", report_to=[], logging_steps=1,
                    disable_tqdm=True, seed=0, dataloader_drop_last=True)
    return transformers.TrainingArguments(**{**settings, **overrides})


def hf_trainer(model, output_dir, scaling: str, callback: bool = False, capture: str | None = None, **overrides):
    from amp_compiler.huggingface import AmpCallback, AmpTrainer
    options = fp8_options(scaling, capture)
    common = dict(model=model, args=trainer_arguments(output_dir, **overrides), train_dataset=task(2 * BATCH),
                  eval_dataset=task(2 * BATCH))   # the rows it learned: eval loss near the last train loss
    if callback:
        return transformers.Trainer(**common, callbacks=[AmpCallback("fp8", **options)])
    return AmpTrainer(**common, amp_level="fp8", amp_options=options)


def trainer_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("scaling, callback, capture", [("current", False, None), ("delayed", False, None),
                                                        ("delayed", True, None), ("current", False, "dynamo")],
                         ids=["current", "delayed", "delayed-callback", "current-dynamo"])
def test_hf_trainer_trains_in_fp8_and_evaluate_records_nothing(tmp_path, scaling, callback, capture):
    model = Mlp()
    trainer = hf_trainer(model, tmp_path, scaling, callback=callback, capture=capture)
    trainer.train()
    assert_fp8_lowered(model, 3)
    losses = trainer_losses(trainer)
    assert len(losses) == 8
    assert_went_down(losses)
    assert len(histories(model)) == (9 if scaling == "delayed" else 0)
    before = histories(model)
    assert trainer.evaluate()["eval_loss"] < losses[0]
    assert all(torch.equal(before[k], v) for k, v in histories(model).items())


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_hf_trainer_checkpoint_keeps_the_delayed_histories_and_resume_ends_where_the_run_does(tmp_path):
    straight = Mlp()
    hf_trainer(straight, tmp_path / "straight", "delayed").train()
    interrupted = Mlp()
    hf_trainer(interrupted, tmp_path / "run", "delayed", save_strategy="steps", save_steps=4, max_steps=4).train()
    resumed = Mlp()
    hf_trainer(resumed, tmp_path / "run", "delayed").train(resume_from_checkpoint=str(tmp_path / "run" /
                                                                                     "checkpoint-4"))
    assert len(histories(straight)) == 9 and histories(straight).keys() == histories(resumed).keys()
    assert all(torch.equal(straight.state_dict()[k], v) for k, v in resumed.state_dict().items())


def tiny_bert() -> transformers.BertForSequenceClassification:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


@pytest.mark.real_models
@pytest.mark.usefixtures("fresh_accelerator_state")
def test_hf_trainer_runs_a_transformers_model_in_fp8_and_its_checkpoints_keep_the_histories(tmp_path):
    """Called with labels, a transformers model is captured whole by torch.export (its matmuls stayed bf16 until
    15ff0fc). The Trainer's checkpoints are save_pretrained's model.safetensors: the histories travel in it and
    resume_from_checkpoint ends where the uninterrupted run does."""
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, 64, (8,), generator=generator), "labels": i % 3} for i in range(16)]
    from amp_compiler.huggingface import AmpTrainer

    def run(output_dir, resume=None, **overrides):
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
        model = tiny_bert()
        trainer = AmpTrainer(model=model, args=trainer_arguments(output_dir, per_device_train_batch_size=4,
                                                                 **overrides),
                             train_dataset=rows, amp_level="fp8", amp_options=fp8_options("delayed"))
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer_losses(trainer)

    straight, losses = run(tmp_path / "straight")
    # q/k/v/o, intermediate, output x 2 layers, pooler (the 3-class head: N=3), in each graph the run made
    assert {fp8_matmuls_in(gm) for gm in converted_graphs(straight)} == {13}
    assert len(losses) == 8 and all(0 < loss < 3 for loss in losses)   # random labels: the MLP tests learn
    run(tmp_path / "run", save_strategy="steps", save_steps=4, max_steps=4)
    resumed, _ = run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-4"))
    assert len(histories(straight)) == 39 and straight.state_dict().keys() == resumed.state_dict().keys()
    assert all(torch.equal(straight.state_dict()[k], v) for k, v in resumed.state_dict().items())


# -- 5. Accelerate ---------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("scaling, capture", SCALINGS_AND_CAPTURES)
def test_accelerate_prepare_trains_in_fp8_and_save_state_keeps_the_histories(tmp_path, scaling, capture):
    from accelerate import Accelerator
    import amp_compiler.accelerate as amp_accelerate

    def run(steps, load_from=None, save_to=None):
        model = Mlp()
        accelerator = Accelerator(mixed_precision="no", cpu=True)
        prepared, optimizer = amp_accelerate.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.5),
                                                     level="fp8", **fp8_options(scaling, capture))
        if load_from:
            accelerator.load_state(load_from)
        losses = []
        for batch in steps:
            loss = prepared(**batch)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if save_to:
            accelerator.save_state(save_to)
        return model, losses

    data = epochs()
    straight, losses = run(data)
    assert_fp8_lowered(straight, 3)
    assert_trained_like_fp32(losses, fp32_losses(data))
    run(data[:4], save_to=tmp_path / "state")
    resumed, _ = run(data[4:], load_from=tmp_path / "state")
    assert straight.state_dict().keys() == resumed.state_dict().keys()
    assert all(torch.equal(straight.state_dict()[k], v) for k, v in resumed.state_dict().items())
