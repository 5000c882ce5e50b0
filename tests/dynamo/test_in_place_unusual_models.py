"""convert(model, inplace=True) (TorchDynamo's capture) against models that do unusual things: the converted model must
compute what the model as written computes (fp32 reference, bf16 tolerance) and leave the user's object as it would be.

Forwards with side effects (an input or buffer updated in place, `self.x = ...`, grad-mode switches), state
changed between calls (plain attributes, tensor attributes, dropout's p, hooks and children added, removed or
replaced), unusual signatures and outputs, shared/tied/parametrized weights, and the graphs' memory.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.dynamo.backend import RecompileLimitWarning
from amp_compiler.converted import compiled_record
from amp_compiler.passes.node_facts import facts

BF16 = torch.bfloat16
ATOL = 0.05   # bf16 matmuls of width 8..16 against fp32


def convert(model):
    return amp_compiler.convert(model, "O1", dtype=BF16, inplace=True)


def matmul_precisions(model) -> dict[str, set]:
    """{module path: the precisions its matmul nodes got} over every graph dynamo made of the model."""
    found: dict[str, set] = {}
    for gm in graphs(model):
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                for n in sub.graph.nodes:
                    if facts(n).get("family") in ("matmul", "attention"):
                        found.setdefault(facts(n).get("module"), set()).add(facts(n).get("precision"))
    return found


def runs_low(model, *modules: str) -> bool:
    """Every matmul of `modules` (all of the model's when none is named) was converted low in every graph dynamo
    made, and no graph fell back to autocast (nor the model, for want of a graph)."""
    state = compiled_record(model)
    if state.converter.fallbacks or state.not_captured is not None:
        return False
    found = matmul_precisions(model)
    return bool(found) and all(found.get(m) == {"low"} for m in (modules or found))


def close(a, b, atol=ATOL):
    return torch.allclose(a, b, rtol=0.02, atol=atol)


def as_written(model_class, model, *args, **kwargs):
    """The class's own forward on the converted model's modules: the model as written, fp32."""
    return model_class.forward(model, *args, **kwargs)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- side effects of the forward -------------------------------------------------------------------------

class MutatesInput(Pair):
    def forward(self, x):
        x.add_(1)
        return self.a(x)


def test_an_input_updated_in_place_is_updated_like_the_model_as_written():
    model = MutatesInput()
    reference = copy.deepcopy(model)
    convert(model)
    x = torch.randn(4, 8)
    x_reference = x.clone()
    for _ in range(3):   # capture, then the graph twice
        assert close(model(x), reference(x_reference))
        assert torch.equal(x, x_reference)
    assert runs_low(model, "a"), matmul_precisions(model)


class RunningStatistics(Pair):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        y = self.a(x)
        if self.training:
            self.calls.add_(1)
            self.mean.mul_(0.9).add_(0.1 * y.mean(0).detach())
        return y - self.mean


def test_buffers_updated_in_forward_are_the_users_buffers():
    model = RunningStatistics()
    reference = copy.deepcopy(model)
    convert(model)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert close(model(x), reference(x))
    assert model.calls.item() == reference.calls.item() == 3
    assert model.mean.dtype == torch.float32 and close(model.mean, reference.mean, atol=1e-3)
    model.eval()
    reference.eval()
    x = torch.randn(4, 8)
    assert close(model(x), reference(x)) and model.calls.item() == 3
    assert runs_low(model, "a"), matmul_precisions(model)


class StoresState(Pair):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.cache = self.a(x)
        self._private_calls = getattr(self, "_private_calls", 0) + 1   # private names count too
        return self.b(self.cache)


def test_a_forward_that_assigns_attributes_keeps_its_assignments_and_runs_low():
    # fixed: the graph dropped `self.x = ...` (calls stayed 0, no cache). Dynamo replays the assignments after
    # its graph (side effects), so the forward itself is converted, not run as written with its children converted
    model = convert(StoresState())
    x = torch.randn(4, 8)
    for _ in range(3):
        out = model(x)
    # the cache is the converted graph's bf16 linear (a child called on its own runs as written: close, not equal;
    # the parts ran `a` converted on its own too, hence their torch.equal)
    assert model.calls == 3 and model._private_calls == 3 and close(model.cache, model.a(x))
    assert close(out, model.b(model.a(x)))
    assert model.cache.dtype == torch.float32   # the dtype the forward as written gives it
    assert runs_low(model, "a", "b"), matmul_precisions(model)


class NoGradBranch(Pair):
    def forward(self, x):
        with torch.no_grad():
            frozen = self.a(x)
        return self.b(x) + frozen


class EnableGradInside(Pair):
    def forward(self, x):
        with torch.enable_grad():
            return self.a(x)


class EnableGradThenSoftmax(Pair):
    def forward(self, x):
        with torch.enable_grad():
            h = self.a(x)
        return h, h.softmax(-1)


class InferenceModeInside(Pair):
    def forward(self, x):
        with torch.inference_mode():
            y = self.a(x)
        return y.clone()


def test_no_grad_inside_the_forward_keeps_its_weights_without_gradients():
    # fixed: fx records tensor ops only; the graph computed a gradient for `a`
    model = convert(NoGradBranch())
    x = torch.randn(4, 8)
    out = model(x)
    assert close(out, as_written(NoGradBranch, model, x))
    out.sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    assert runs_low(model, "a", "b"), matmul_precisions(model)   # both still run low


def test_enable_grad_inside_the_forward_is_kept():
    """The output's cast back to fp32 was placed after the graph's _set_grad_enabled(False) that ends the
    `with torch.enable_grad()` region: under a caller's no_grad the returned tensor had no grad_fn."""
    model = convert(EnableGradInside())
    with torch.no_grad():
        out = model(torch.randn(4, 8))
    assert out.requires_grad and out.dtype == torch.float32   # as written: enable_grad wins over the caller's no_grad
    assert runs_low(model, "a"), matmul_precisions(model)
    shared = convert(EnableGradThenSoftmax())   # the value read in fp32 after the region too: its cast was shared
    with torch.no_grad():
        hidden, probabilities = shared(torch.randn(4, 8))
    assert hidden.requires_grad and not probabilities.requires_grad


def test_inference_mode_inside_the_forward_is_kept():
    model = convert(InferenceModeInside())
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    assert not out.requires_grad and close(out, as_written(InferenceModeInside, model, x))
    assert runs_low(model, "a"), matmul_precisions(model)


# -- state changed between calls -------------------------------------------------------------------------

class Scaled(Pair):
    def __init__(self):
        super().__init__()
        self.step = 0
        self.scale = torch.tensor(2.0)   # a plain tensor attribute, not a buffer

    def forward(self, x):
        return self.a(x) * self.step * self.scale


def test_plain_and_tensor_attributes_changed_after_capture_are_read_again():
    # fixed: both were baked into the graph (errors 13 and 3.4)
    model = convert(Scaled())
    x = torch.randn(4, 8)
    model(x)
    model.step = 5
    assert close(model(x), as_written(Scaled, model, x))
    model.scale = torch.tensor(-3.0)
    assert close(model(x), as_written(Scaled, model, x))
    with torch.no_grad():
        model.scale.fill_(7.0)   # in place: the same tensor, no new graph needed
    made = len(graphs(model))
    assert close(model(x), as_written(Scaled, model, x)) and len(graphs(model)) == made
    assert runs_low(model, "a"), matmul_precisions(model)


class Settings:
    def __init__(self):
        self.negate = False


class ReadsSettings(Pair):
    def __init__(self, settings):
        super().__init__()
        self.settings = settings

    def forward(self, x):
        y = self.a(x)
        return -y if self.settings.negate else y


def test_a_settings_object_changed_after_capture_is_read_again():
    # fixed: `model.config.flag = True` after the first call was ignored (the graph had baked False)
    model = convert(ReadsSettings(Settings()))
    x = torch.randn(4, 8)
    model(x)
    model.settings.negate = True
    assert close(model(x), as_written(ReadsSettings, model, x))
    assert runs_low(model, "a"), matmul_precisions(model)


@pytest.mark.real_models
def test_a_hugging_face_config_changed_after_capture_is_followed():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = convert(LlamaForCausalLM(config).eval())
    ids = torch.randint(0, 64, (1, 5))
    assert model(ids, use_cache=False).hidden_states is None
    model.config.output_hidden_states = True
    out = model(ids, use_cache=False)
    assert out.hidden_states is not None and len(out.hidden_states) == 2
    assert close(out.logits, as_written(LlamaForCausalLM, model, ids, use_cache=False).logits)
    assert runs_low(model), matmul_precisions(model)


class Switches(Pair):
    def __init__(self):
        super().__init__()
        self.active = [True, False]

    def forward(self, x):
        y = self.a(x) if self.active[0] else x
        return self.b(y) if self.active[1] else y


def test_a_list_attribute_changed_in_place_after_capture_is_read_again():
    # fixed: the same list object, so an identity check missed it (error 1.5)
    model = convert(Switches())
    x = torch.randn(4, 8)
    model(x)
    model.active[1] = True
    assert close(model(x), as_written(Switches, model, x))
    assert runs_low(model, "a", "b"), matmul_precisions(model)


def zeroing_forward(x):
    return x * 0


def test_an_instance_forward_on_a_leaf_is_what_runs():
    # fixed: a Linear with `linear.forward = ...` (a wrapper, a patch) was lowered as a plain Linear
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x)
    model.a.forward = zeroing_forward   # after the capture
    assert close(model(x), model.b(torch.zeros(4, 8)))
    patched = nn.Linear(8, 8)
    patched.forward = zeroing_forward   # before the conversion: the part itself
    assert torch.equal(convert(patched)(x), torch.zeros(4, 8))
    assert runs_low(model, "b"), matmul_precisions(model)


# fixed: frontend.fx_capture.is_leaf_module kept such a Linear as a leaf: the graph computed the class's linear
def test_convert_of_a_model_whose_leaf_has_an_instance_forward():
    model = Pair()
    model.a.forward = zeroing_forward
    x = torch.randn(4, 8)
    assert close(amp_compiler.convert(model, "O1", dtype=BF16)(x), model.b(torch.zeros(4, 8)))


def test_dropout_probability_changed_after_capture_is_followed():
    # fixed: p=0 at capture left no dropout in the graph
    model = convert(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)))
    x = torch.randn(4, 8)
    model(x)
    model[1].p = 1.0
    assert torch.equal(model(x), torch.zeros(4, 8))
    assert runs_low(model, "0"), matmul_precisions(model)


@pytest.mark.xfail(strict=True, reason="open: TorchDynamo does not guard on a submodule's hooks by default "
                   "(torch._dynamo.config.skip_nnmodule_hook_guards=True; the compiled forward's CAPTURE_SETTINGS "
                   "leave it), so a forward hook added to a child after the first call never fires: the graph "
                   "inlined the child without it. A hook on the model itself runs (it is outside the compiled "
                   "forward)")
def test_hooks_added_and_removed_on_a_child_after_capture():
    # fixed: the graph had traced through the child (a new hook never fired) or kept a copy of its hook dict
    # (a removed hook still fired)
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x)
    handle = model.a.register_forward_hook(lambda module, args, output: output * 0)
    assert close(model(x), model.b(torch.zeros(4, 8)))
    handle.remove()
    assert close(model(x), as_written(Pair, model, x))


def test_a_child_replaced_after_capture_is_the_one_called():
    # fixed: the graph's copy of the old child read the old child's weights
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x)
    model.a = nn.Linear(8, 8)
    assert close(model(x), as_written(Pair, model, x))
    assert runs_low(model, "a", "b"), matmul_precisions(model)   # the same graph reads the new child's weights


def test_a_new_parameter_assigned_after_capture_is_read():
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x)
    model.a.weight = nn.Parameter(torch.zeros(8, 8))
    assert close(model(x), as_written(Pair, model, x))
    assert runs_low(model, "a", "b"), matmul_precisions(model)


def test_frozen_weights_get_no_gradient():
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    model.a.requires_grad_(False)
    model(x).sum().backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    assert runs_low(model, "a", "b"), matmul_precisions(model)


def test_to_float64_and_half_after_conversion():
    model = convert(Pair())
    x = torch.randn(4, 8)
    model(x)
    model.double()
    assert model(x.double()).dtype == torch.float64
    assert torch.allclose(model(x.double()), as_written(Pair, model, x.double()))   # float64 is never cast
    model.half()
    out = model(x.half())
    assert out.dtype == torch.float16 and close(out.float(), as_written(Pair, model, x.half()).float())
    assert len(graphs(model)) == 3   # a graph per dtype: dynamo guards on the weights' and inputs' dtypes


# -- signatures ------------------------------------------------------------------------------------------

class Flexible(Pair):
    def forward(self, *inputs, scale=1.0, flag=False, extra=None, **named):
        y = sum(self.a(t) for t in inputs) * scale
        y = -y if flag else y
        y = y if extra is None else y + extra
        return y + sum(named.values()) if named else y


@pytest.mark.parametrize("args, kwargs", [
    ((1,), {}), ((2,), {}), ((3,), {"scale": 2.0}), ((1,), {"flag": True}), ((1,), {"extra": 1}),
    ((1,), {"extra": None}), ((1,), {"q": 1}), ((1,), {"q": 1, "r": 1})])
def test_var_args_keywords_and_optional_tensors(args, kwargs):
    model = convert(Flexible())
    x = torch.randn(4, 8)
    call_args = (x,) * args[0]
    call_kwargs = {k: (x if v == 1 else v) for k, v in kwargs.items() if k != "scale" and k != "flag"}
    call_kwargs.update({k: v for k, v in kwargs.items() if k in ("scale", "flag")})
    model(*call_args, **call_kwargs)   # capture
    assert close(model(*call_args, **call_kwargs), as_written(Flexible, model, *call_args, **call_kwargs))
    assert runs_low(model, "a"), matmul_precisions(model)


class Structured(Pair):
    def forward(self, tensors: list, named: dict, positional_flag: bool, offset: int):
        y = torch.stack([self.a(t) for t in tensors]).sum(0) + self.b(named["k"]) + offset
        return -y if positional_flag else y


def test_lists_of_varying_length_dicts_bools_and_an_offset_per_call():
    # the parts captured once per call form up to their limit, then ran as written (said once); dynamo makes a
    # graph per list length and flag and takes the offset as a symbolic int: every call runs converted
    model = convert(Structured())
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(12):
            args = ([x] * (1 + call % 3), {"k": x}, call % 2 == 0, call)
            out = model(*args)
            expected = as_written(Structured, model, *args)
            assert close(out, expected) and not torch.equal(out, expected), call   # equal: it ran fp32
    assert not any(issubclass(w.category, RecompileLimitWarning) for w in caught)
    assert len(graphs(model)) < 12 and runs_low(model, "a", "b"), matmul_precisions(model)


@dataclasses.dataclass
class Output:
    y: torch.Tensor
    x: torch.Tensor


class ReturnsStructures(Pair):
    def forward(self, x):
        return Output(self.a(x), x), {"y": self.b(x), "x": x}, x


def test_dataclass_dict_and_the_input_itself_come_back():
    model = convert(ReturnsStructures())
    x = torch.randn(4, 8)
    model(x)
    output, named, same = model(x)
    assert type(output) is Output and output.x is x and named["x"] is x and same is x
    expected = as_written(ReturnsStructures, model, x)
    assert close(output.y, expected[0].y) and close(named["y"], expected[1]["y"])
    assert runs_low(model, "a", "b"), matmul_precisions(model)


# -- shared, tied and parametrized weights -----------------------------------------------------------------

class SharedChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.branch = nn.Sequential(self.a, nn.ReLU())   # the same Linear by two paths

    def forward(self, x):
        return self.branch(self.a(x)) + self.a(2 * x)   # and called three times


class Peer(nn.Module):
    def __init__(self, peer):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        object.__setattr__(self, "peer", peer)   # a sibling reached through a plain attribute

    def forward(self, x):
        return self.peer(self.proj(x))


class CallsSibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Linear(8, 8)
        self.a = Peer(self.b)

    def forward(self, x, state=None):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("model_class", [SharedChild, CallsSibling])
def test_modules_shared_between_paths_or_called_through_a_sibling(model_class):
    model = model_class()
    reference = copy.deepcopy(model)
    convert(model)
    x = torch.randn(4, 8)
    for state in (None, object()):   # the parts ran the root as written for an object; dynamo: the same graph
        args = (x,) if model_class is SharedChild else (x, state)
        assert close(model(*args), reference(*args))
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert close(p.grad, q.grad, atol=0.1), name
    assert [n for n, _ in model.named_modules()] == [n for n, _ in reference.named_modules()]
    assert runs_low(model), matmul_precisions(model)


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_weights_stay_tied_and_get_both_gradients():
    model = TiedHead()
    reference = copy.deepcopy(model)
    convert(model)
    ids = torch.randint(0, 16, (2, 5))
    assert close(model(ids), reference(ids))
    model(ids).sum().backward()
    reference(ids).sum().backward()
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    assert close(model.embed.weight.grad, reference.embed.weight.grad, atol=0.1)
    assert runs_low(model, "head"), matmul_precisions(model)


class Symmetric(nn.Module):
    def forward(self, weight):
        return weight.triu() + weight.triu(1).T


def test_parametrized_and_weight_normed_weights_follow_their_originals():
    model = Pair()
    parametrize.register_parametrization(model.a, "weight", Symmetric())
    model.b = nn.utils.parametrizations.weight_norm(model.b)
    reference = copy.deepcopy(model)
    convert(model)
    x = torch.randn(4, 8)
    assert close(model(x), reference(x))
    model(x).sum().backward()
    reference(x).sum().backward()
    original = model.a.parametrizations.weight.original
    assert close(original.grad, reference.a.parametrizations.weight.original.grad, atol=0.1)
    with torch.no_grad():
        for m in (model, reference):
            m.a.parametrizations.weight.original.mul_(2)
            m.b.parametrizations.weight.original0.mul_(3)
    assert close(model(x), reference(x), atol=0.1)
    assert runs_low(model, "a", "b"), matmul_precisions(model)


# -- autograd features, modes and memory -----------------------------------------------------------------

class Checkpointed(Pair):
    def forward(self, x):
        return checkpoint(self.a, x, use_reentrant=False) + self.b(x)


def test_gradient_checkpointing_inside_the_forward():
    model = Checkpointed()
    reference = copy.deepcopy(model)
    convert(model)
    x = torch.randn(4, 8)
    out = model(x)
    out.sum().backward()
    reference(x).sum().backward()
    assert close(out, reference(x))
    assert close(model.a.weight.grad, reference.a.weight.grad, atol=0.1)
    assert runs_low(model, "a", "b"), matmul_precisions(model)


def test_inference_mode_calls_then_training_calls():
    model = Pair()
    reference = copy.deepcopy(model)
    convert(model)
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert close(model(x), reference(x))
    out = model(x)
    out.sum().backward()
    reference(x).sum().backward()
    assert close(model.a.weight.grad, reference.a.weight.grad, atol=0.1)
    assert runs_low(model, "a", "b"), matmul_precisions(model)


def test_the_users_model_object_is_unchanged_by_calls():
    model = RunningStatistics()
    parameters = {name: (p, p.dtype) for name, p in model.named_parameters()}
    modules = [name for name, _ in model.named_modules()]
    keys = list(model.state_dict())
    convert(model)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x)
    assert {name: (p, p.dtype) for name, p in model.named_parameters()} == parameters
    assert [name for name, _ in model.named_modules()] == modules and list(model.state_dict()) == keys
    assert all(not m.training for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert runs_low(model, "a"), matmul_precisions(model)


def _storage_alive(pointer: int) -> bool:
    def storage(t):
        try:
            return t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - fake tensors have none
            return None
    return any(isinstance(t, torch.Tensor) and storage(t) == pointer for t in gc.get_objects())


@pytest.mark.parametrize("weight_cache", [False, True])   # the parts' freeze=True: dynamo's weight cache
def test_the_inputs_of_a_call_are_freed_after_it(weight_cache):
    model = amp_compiler.convert(Pair(), "O1", dtype=BF16, inplace=True, weight_cache=weight_cache)
    for call in range(3):   # the capturing call, a training call, an eval call
        x = torch.randn(64, 8, requires_grad=call == 1)
        pointer, alive = x.untyped_storage().data_ptr(), weakref.ref(x)
        out = model(x)
        if call == 1:
            out.sum().backward()
        del x, out
        gc.collect()
        assert alive() is None and not _storage_alive(pointer), call
    assert runs_low(model), matmul_precisions(model)


NEGATE = [False]   # module-level state a forward reads


class ReadsAGlobal(Pair):
    def forward(self, x):
        return -self.a(x) if NEGATE[0] else self.a(x)


def test_a_global_read_by_the_forward_changed_after_capture():
    # the parts baked it into the graph (an xfail there); dynamo guards on the globals a frame reads
    model = convert(ReadsAGlobal())
    x = torch.randn(4, 8)
    model(x)
    NEGATE[0] = True
    try:
        assert close(model(x), as_written(ReadsAGlobal, model, x))
        assert runs_low(model, "a") and len(graphs(model)) == 2, matmul_precisions(model)   # a graph per value
    finally:
        NEGATE[0] = False


def test_convert_never_trains_a_model_whose_parameters_torch_export_took_as_constants():
    # convert() (not in place): a torch.export graph that took a sibling's parameters as constants is refused by
    # the capture (frontend/capture.py); here fx's graph is kept either way, and the sibling's gradients arrive
    model, reference = CallsSibling(), None
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    gm(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and close(p.grad, q.grad, atol=0.1), name
