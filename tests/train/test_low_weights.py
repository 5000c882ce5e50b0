"""O2 with low-precision weights and fp32 masters (amp_compiler/train/low_weights.py): the same updates as
casting every weight in every forward, no weight cast left in the step, skipped steps touch nothing,
accumulation sums in fp32, checkpoints hold the masters."""
import contextlib
import copy

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler import DynamicLossScaleManager, FixedLossScaleManager, build_train_network, convert, low_weights
from amp_compiler.passes.fx.runtime import is_cast

aten = torch.ops.aten


class LayerNormMLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.inp = nn.Linear(12, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(2))
        self.out = nn.Linear(width, 5)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


class TiedEmbedding(nn.Module):
    """The embedding table is read by an fp32 op (the lookup) and by a low matmul (the output): stays fp32."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, tokens):
        return self.mid(self.embed(tokens)) @ self.embed.weight.t()


def make(kind=LayerNormMLP, seed=0):
    torch.manual_seed(seed)
    return kind()


def batch(step, n=16):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(n, 12, generator=generator), torch.randint(0, 5, (n,), generator=generator)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b, **tolerance):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **tolerance)


# -- build_train_network ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_updates_match_casting_every_forward(dtype):
    runs = {}
    for store in (True, False):
        model = make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), "O2", dtype=dtype,
                                   store_weights_low=store)
        for i in range(20):
            step(*batch(i))
        runs[store] = (params(model), step)
    assert runs[True][1].low_weights is not None and runs[False][1].low_weights is None
    assert_same(runs[True][0], runs[False][0], rtol=0, atol=0)   # the copies are exactly the casts of the masters
    assert all(p.dtype == torch.float32 for p in runs[True][0])


def forward_weight_casts(step_graph):
    """Dtype casts that read a parameter placeholder directly: a weight cast per step."""
    return [n for n in step_graph.graph.nodes if n.target is aten._to_copy.default
            and n.args[0].op == "placeholder" and n.args[0].name.startswith("p_")]


def test_step_graph_casts_no_stored_weight():
    model, other = make(), make()
    casting = build_train_network(other, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                  "O2", dtype=torch.bfloat16, store_weights_low=False)
    stored = build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                 "O2", dtype=torch.bfloat16)
    x, y = batch(0)
    before, after = casting.graph_for(x, y), stored.graph_for(x, y)
    assert len(forward_weight_casts(before)) >= 4   # the three Linear weights and biases, cast every step
    assert forward_weight_casts(after) == []
    stored_names = {name for pair in stored.low_weights.pairs for name in pair.names}
    assert {"inp.weight", "out.weight", "blocks.0.1.weight"} <= stored_names
    assert not any("blocks.0.0" in name for name in stored_names)   # LayerNorm weights: read by an fp32 op


def test_skipped_step_touches_masters_copies_and_optimizer_state():
    model = make()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), "O2", dtype=torch.float16,
                               loss_scale_manager=DynamicLossScaleManager(2 ** 10))
    step(*batch(0))
    masters, copies = params(model), [p.low.detach().clone() for p in step.low_weights.pairs]
    state = [v.clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    x, y = batch(1)
    x[0, 0] = float("inf")
    _, overflow, _ = step(x, y)
    assert overflow is amp_compiler.Overflow.SKIPPED
    assert_same(params(model), masters, rtol=0, atol=0)
    assert_same([p.low for p in step.low_weights.pairs], copies, rtol=0, atol=0)
    assert_same([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)], state,
                rtol=0, atol=0)
    _, overflow, _ = step(*batch(2))   # the next clean step applies, and remakes the copies from the masters
    assert not overflow   # the applied step remade the copies from the masters
    for pair in step.low_weights.pairs:
        assert torch.equal(pair.low, pair.master.to(torch.float16))


# -- a plain loop -------------------------------------------------------------------------------------------
def plain_loop(store: bool, steps=12, micro_batches=1, dtype=torch.bfloat16, scaler=None, clip=None,
               kind=LayerNormMLP, make_inputs=batch, optimizer_class=torch.optim.AdamW, **optimizer_options):
    model = make(kind)
    gm = convert(model, "O2", dtype=dtype)
    optimizer = optimizer_class([{"params": [p for n, p in model.named_parameters() if "bias" not in n]},
                                 {"params": [p for n, p in model.named_parameters() if "bias" in n],
                                  "weight_decay": 0.0}], lr=1e-2, **optimizer_options)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    weights = low_weights(gm, optimizer) if store else None
    for i in range(steps):
        for k in range(micro_batches):
            x, y = make_inputs(100 * i + k)
            loss = nn.functional.cross_entropy(gm(x), y) / micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return model, gm, weights


@pytest.mark.parametrize("clip", [None, 0.05])
def test_plain_loop_with_groups_scheduler_and_clipping_matches(clip):
    stored, _, weights = plain_loop(True, clip=clip)
    casting, _, _ = plain_loop(False, clip=clip)
    assert len(weights.pairs) == 8   # 4 Linear weights and 4 biases
    assert_same(params(stored), params(casting), rtol=0, atol=0)


@pytest.mark.parametrize("make_scaler", [lambda: amp_compiler.GradScaler(init_scale=2.0 ** 12),
                                         lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)],
                         ids=["ours", "torch"])
def test_plain_loop_fp16_with_a_scaler_matches(make_scaler):
    stored, _, _ = plain_loop(True, dtype=torch.float16, scaler=make_scaler(), steps=6)
    casting, _, _ = plain_loop(False, dtype=torch.float16, scaler=make_scaler(), steps=6)
    assert_same(params(stored), params(casting), rtol=0, atol=0)


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}), (torch.optim.Adam, {"foreach": True}),
    (torch.optim.AdamW, {"fused": True}), (torch.optim.RMSprop, {}), (torch.optim.Adagrad, {})],
    ids=lambda value: getattr(value, "__name__", "")[:8])
def test_any_optimizer_steps_the_masters(optimizer_class, options):
    stored, _, _ = plain_loop(True, steps=5, optimizer_class=optimizer_class, **options)
    casting, _, _ = plain_loop(False, steps=5, optimizer_class=optimizer_class, **options)
    assert_same(params(stored), params(casting), rtol=0, atol=0)


def test_accumulation_sums_in_fp32_and_casts_once_per_step():
    stored, gm, weights = plain_loop(True, steps=4, micro_batches=4)
    casting, _, _ = plain_loop(False, steps=4, micro_batches=4)
    # the same low gradients, summed in fp32 in both (the casting graph casts each one up in its backward)
    assert_same(params(stored), params(casting), rtol=1e-6, atol=1e-7)
    optimizer = torch.optim.SGD(stored.parameters(), lr=0.1)
    remade = []
    original = weights.refresh
    weights.refresh = lambda only_stale=True: remade.append(original(only_stale)) or remade[-1]
    for k in range(4):
        nn.functional.cross_entropy(gm(batch(k)[0]), batch(k)[1]).backward()
    optimizer.step()
    gm(batch(0)[0])
    # micro-batches remake nothing; the step (of an optimizer low_weights was not given: it holds the masters)
    # remakes all, once, and the forward after it none
    assert remade == [0, 0, 0, 0, len(weights.pairs), 0]


def test_gradients_reach_masters_in_fp32_and_the_copies_are_cleared():
    model = make()
    gm = convert(model, "O2", dtype=torch.bfloat16)
    weights = low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0)
    nn.functional.cross_entropy(gm(x), y).backward()
    for pair in weights.pairs:
        assert pair.low.grad is None and pair.master.grad.dtype == torch.float32
    first = model.inp.weight.grad.clone()
    nn.functional.cross_entropy(gm(x), y).backward()
    torch.testing.assert_close(model.inp.weight.grad, 2 * first)


def test_tied_weight_read_by_an_fp32_op_stays_fp32():
    model = make(TiedEmbedding)
    gm = convert(model, "O2", dtype=torch.bfloat16)
    weights = low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    names = {name for pair in weights.pairs for name in pair.names}
    assert "mid.weight" in names and not any(name.startswith("embed") for name in names)
    assert gm.get_parameter("embed.weight") is model.embed.weight


def test_users_model_keeps_fp32_parameters_and_runs_as_before():
    model = make()
    x, _ = batch(0)
    expected = model(x)
    gm = convert(model, "O2", dtype=torch.bfloat16)
    low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


# -- checkpoints and edits of the masters ---------------------------------------------------------------------
def test_checkpoint_holds_masters_and_loads_into_them():
    trained, gm, weights = plain_loop(True, steps=5)
    state = gm.state_dict()
    for pair in weights.pairs:
        for name in pair.names:
            assert state[name].dtype == torch.float32 and torch.equal(state[name], pair.master)
    fresh = make(seed=1)
    fresh_gm = convert(fresh, "O2", dtype=torch.bfloat16)
    low_weights(fresh_gm, torch.optim.AdamW(fresh.parameters()))
    fresh_gm.load_state_dict(state)
    assert_same(params(fresh), params(trained), rtol=0, atol=0)   # the masters, not their low rounding
    x, _ = batch(7)
    torch.testing.assert_close(fresh_gm(x), gm(x), rtol=0, atol=0)


def test_an_edit_of_the_masters_reaches_the_next_forward():
    model = make()
    gm = convert(model, "O2", dtype=torch.bfloat16)
    low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    x, _ = batch(0)
    before = gm(x)
    model.load_state_dict(make(seed=3).state_dict())   # the user's model: the masters
    after = gm(x)
    reference = convert(make(seed=3), "O2", dtype=torch.bfloat16)(x)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, reference, rtol=0, atol=0)


def test_remove_puts_the_masters_back():
    model = make()
    gm = convert(model, "O2", dtype=torch.bfloat16)
    x, _ = batch(0)
    expected = gm(x)
    weights = low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    weights.remove()
    assert all(p is q for p, q in zip(gm.parameters(), model.parameters()))
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)


def test_refusals_name_the_problem():
    model = make()
    with pytest.raises(ValueError, match="no weight of this graph"):
        low_weights(convert(model, "O0"), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="GraphModule"):
        low_weights(model, torch.optim.SGD(model.parameters(), lr=0.1))
    in_place = convert(make(), "O2", inplace=True)
    with pytest.raises(TypeError, match="initialize"):
        low_weights(in_place, torch.optim.SGD(in_place.parameters(), lr=0.1))
    gm = convert(model, "O2", dtype=torch.bfloat16)
    low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="already"):
        low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.1))


# -- what a second reading found (each silently wrong before its fix) -----------------------------------------
class ReadsTraining(nn.Module):
    """In eval an fp32 op (layer_norm's weight) reads out.bias, which training reads only through a cast."""
    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(12, 12), nn.Linear(12, 5)

    def forward(self, x):
        h = self.out(torch.relu(self.a(x)))
        return h if self.training else nn.functional.layer_norm(h, (5,), weight=self.out.bias)


def one_step(gm, optimizer, step=0):
    x, y = batch(step)
    nn.functional.cross_entropy(gm(x).float(), y).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("store", [True, False])
def test_a_master_frozen_after_low_weights_stays_put(store):
    model = make()
    gm = convert(model, "O2", dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if store:
        low_weights(gm, optimizer)
    model.inp.weight.requires_grad_(False)
    before = model.inp.weight.clone()
    for step in range(3):
        one_step(gm, optimizer, step)
    assert torch.equal(model.inp.weight, before) and model.inp.weight.grad is None


def test_a_failed_backward_neither_stops_training_nor_leaks_its_gradients():
    runs = {}
    for store in (True, False):
        model = make()
        gm = convert(model, "O2", dtype=torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        if store:
            low_weights(gm, optimizer)
        x, y = batch(0)
        x.requires_grad_(True).register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("failing hook")))
        with pytest.raises(RuntimeError, match="failing hook"):
            nn.functional.cross_entropy(gm(x), y).backward()   # the weights' gradients arrived before the input's
        optimizer.zero_grad()
        with pytest.warns(RuntimeWarning, match="dropped") if store else contextlib.nullcontext():
            for step in range(1, 4):
                one_step(gm, optimizer, step)
        runs[store] = params(model)
    assert_same(runs[True], runs[False], rtol=0, atol=0)


def test_the_step_models_converted_graph_follows_a_loaded_checkpoint():
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = build_train_network(model, optimizer, nn.CrossEntropyLoss(), "O2", dtype=torch.bfloat16)
    step(*batch(0))
    model.load_state_dict(make(seed=4).state_dict())
    x, _ = batch(1)
    expected = convert(make(seed=4), "O2", dtype=torch.bfloat16)(x)
    torch.testing.assert_close(step.converted(x), expected, rtol=0, atol=0)


def test_a_tied_weight_loads_under_either_name():
    model = make()
    model.out2 = model.out   # the same Parameters under two names, both read through casts only
    gm = convert(model, "O2", dtype=torch.bfloat16)
    weights = low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.5))
    tied = next(pair for pair in weights.pairs if len(pair.names) > 1)
    value = torch.randn_like(tied.master)
    gm.load_state_dict({tied.names[-1]: value}, strict=False)
    assert torch.equal(tied.master, value) and torch.equal(gm.state_dict()[tied.names[0]], value)


def test_deepcopy_gets_fp32_masters_and_shares_nothing_and_save_is_refused(tmp_path):
    trained, gm, weights = plain_loop(True, steps=3)
    copied = copy.deepcopy(gm)
    for pair in weights.pairs:
        for name in pair.names:
            held = copied.get_parameter(name)
            assert held.dtype == torch.float32 and torch.equal(held, pair.master) and held is not pair.master
    x, _ = batch(5)
    torch.testing.assert_close(copied(x), gm(x), rtol=0, atol=0)
    copied.load_state_dict({k: torch.zeros_like(v) for k, v in copied.state_dict().items()})
    assert trained.inp.weight.abs().sum() > 0   # the original's masters untouched
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(gm, tmp_path / "gm.pt")
    torch.save(gm.state_dict(), tmp_path / "state.pt")


def test_replaced_copies_are_refused_at_the_next_forward():
    model = make()
    gm = convert(model, "O2", dtype=torch.bfloat16)
    low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.5))
    gm.inp.weight = nn.Parameter(torch.zeros_like(gm.inp.weight))   # as fully_shard or to_empty would
    with pytest.raises(RuntimeError, match="no longer the low copy"):
        gm(batch(0)[0])


def test_ddp_built_before_low_weights_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    created = not dist.is_initialized()   # an earlier test in this process may have left one (world size 1)
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = make()
        gm = convert(model, "O2", dtype=torch.bfloat16)
        ddp = DistributedDataParallel(gm)
        low_weights(gm, torch.optim.SGD(model.parameters(), lr=0.5))
        with pytest.raises(RuntimeError, match="built before low_weights"):
            ddp(batch(0)[0])
    finally:
        if created:
            dist.destroy_process_group()


def test_a_graph_switched_by_the_mode_puts_back_masters_it_reads_in_fp32():
    results = {}
    for store in (True, False):
        model = make(ReadsTraining)
        gm = convert(model, "O2", dtype=torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        weights = low_weights(gm, optimizer) if store else None
        one_step(gm, optimizer)
        gm.eval()
        with torch.no_grad():
            results[store] = gm(batch(1)[0])
        if store:
            assert gm.out.bias.dtype == torch.float32 and "out.bias" not in {n for p in weights.pairs for n in p.names}
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)


# -- the mechanism both O2 front ends share (low_weights() and Apex's initialize) -----------------------------------
def test_master_weights_fold_unscale_and_copy():
    """MasterWeights, which LowWeights and apex.OptimizerStash are built on: the fold adds the lows' gradients
    into the masters' .grad in fp32 (a copy where none), unscaling on the way when given 1/scale and saying
    whether any was inf/nan; the copy remakes the lows from the masters."""
    from amp_compiler.train.low_weights import MasterPair, MasterWeights
    masters = [nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([3.0]))]
    lows = [nn.Parameter(m.detach().to(torch.float16)) for m in masters]
    weights = MasterWeights()
    for low, master in zip(lows, masters):
        weights.add_pair(MasterPair(low=low, master=master))
    assert weights.master_of(lows[1]) is masters[1] and weights.master_of(masters[0]) is masters[0]
    masters[1].grad = torch.tensor([0.5])
    lows[0].grad = torch.tensor([8.0, 16.0], dtype=torch.float16)
    lows[1].grad = torch.tensor([4.0], dtype=torch.float16)
    assert weights.fold(inv_scale=0.25, clear_low=False) == (2, False)
    assert torch.equal(masters[0].grad, torch.tensor([2.0, 4.0])) and torch.equal(masters[1].grad, torch.tensor([1.5]))
    assert masters[0].grad.dtype == torch.float32 and lows[0].grad is not None   # clear_low=False keeps them
    lows[1].grad = torch.tensor([float("inf")], dtype=torch.float16)
    lows[0].grad = None
    assert weights.fold(inv_scale=1.0) == (1, True) and lows[1].grad is None
    assert weights.fold() == (0, False)
    with torch.no_grad():
        masters[0].mul_(3)
    assert weights.copy_masters_to_low() == 2 and torch.equal(lows[0], torch.tensor([3.0, 6.0], dtype=torch.float16))
    optimizer = torch.optim.SGD([masters[0]], lr=1.0)
    handle = weights.copy_after_steps(optimizer)
    masters[0].grad = torch.ones(2)
    optimizer.step()
    assert torch.equal(lows[0], torch.tensor([2.0, 5.0], dtype=torch.float16))
    handle.remove()
