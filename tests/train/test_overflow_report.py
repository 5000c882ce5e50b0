"""locate_overflow(model, replay): the first node whose value or gradient went non-finite in a replayed step.

Overflows are planted where the test can compute them independently: a Linear whose fp16 output passes
65504 (its fp32 output does not), a loss scale whose gradient passes 65504 once cast to fp16, a custom
autograd.Function returning an inf gradient, fp16 code run as written. Each report is checked against the
graph's own nodes and module paths, and the model is checked to be exactly as the replay found it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs as dynamo_graphs
from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.compile import compile_children
from amp_compiler.insight.graph_decisions import module_of
from amp_compiler.passes.node_facts import facts
from amp_compiler.train import overflow_report
from amp_compiler.train.grad_scaler import GradScaler
from amp_compiler.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager
from amp_compiler.train.overflow_report import OverflowReport, locate_overflow, replay_rng, rng_state

FP16_MAX = torch.finfo(torch.float16).max
PLANTED = 1000.0          # every weight of the planted Linear; inputs of 10 over 8 features: 80000 > FP16_MAX


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class InfGradient(torch.autograd.Function):
    """Identity forward; its backward returns an inf gradient (a broken custom op)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Amplify(nn.Module):
    """fp16 code the conversion never sees when it runs as written: parameterless, so compile_children leaves it
    uncompiled."""

    def forward(self, x):
        return (x.half() * 1e5).float()


class Branchy(nn.Module):
    """A data-dependent branch: compiled at its root, dynamo breaks the graph there (pre's graph, then one of the
    rest); with compile_children the root runs as written, pre and post compiled, amplify as written."""

    def __init__(self, plant=None):
        super().__init__()
        self.pre, self.amplify, self.post = nn.Linear(8, 8), Amplify(), nn.Linear(8, 4)
        self.plant = plant

    def forward(self, x):
        h = self.pre(x)
        if h.abs().max() > 1e9:
            h = h / 2
        if self.plant == "module":
            h = self.amplify(h)
        elif self.plant == "own code":
            h = (h.half() * 1e5).float()
        elif self.plant == "gradient":
            h = InfGradient.apply(h)
        return self.post(h)


def planted_mlp():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.layers[1].up.weight.fill_(PLANTED)
    return model


def inputs():
    return torch.full((2, 8), 10.0)


def replay_of(model, x, scale=1.0):
    return lambda: (model(x).sum() * scale).backward()


def on_dynamo(model, **options):
    return amp_compiler.convert(model, "O1", dtype=torch.float16, inplace=True, capture="dynamo", **options)


def children_compiled(model):
    """What Lightning's plugin does with a LightningModule: each child with parameters compiled, the root as written."""
    return compile_children(model, "O1", dtype=torch.float16, backend="eager")


def the_node(gm, module, op):
    """The single node of `gm` with this op whose module (module_of) is `module`: the expected answer."""
    found = [n.name for n in gm.graph.nodes if module_of(n) == module and facts(n).get("op") == op]
    assert len(found) == 1, found
    return found[0]


def dynamo_graph(model):
    (gm,) = dynamo_graphs(model)
    return gm


def snapshot(model):
    """Everything the replay must leave as it was: .grad values, the graphs (none made by the replay) and their
    forwards, the compiled forwards."""
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    graphs = _graph_modules(model)
    forwards = [(id(gm), "forward" in gm.__dict__, gm.__dict__.get("forward")) for gm in graphs]
    compiled = [(path, compiled_record(m), m.__dict__.get("forward")) for path, m in model.named_modules()]
    return grads, forwards, compiled


def _graph_modules(model):
    """dynamo's graphs of every compiled module in the model, and the GraphModules in its tree."""
    return [gm for m in model.modules() for gm in dynamo_graphs(m)] + \
        [m for m in model.modules() if isinstance(m, torch.fx.GraphModule)]


def assert_unchanged(model, before):
    grads, forwards, compiled = snapshot(model)
    assert forwards == before[1]
    assert compiled == before[2]
    assert grads.keys() == before[0].keys()
    for name, grad in grads.items():
        old = before[0][name]
        assert (grad is None) == (old is None), name
        if grad is not None:
            assert torch.equal(grad.nan_to_num(), old.nan_to_num()), name


# --- (1) forward overflow in a model converted in place ------------------------------------------------
def test_forward_overflow_names_the_linear_node_and_its_module_path():
    reference = planted_mlp()
    x = inputs()
    with torch.no_grad():   # the plant: fp32 stays finite, the planted Linear's output passes fp16's range
        h = x + reference.layers[0](x)
        up = reference.layers[1].up(h)
    assert torch.isfinite(reference(x)).all() and up.abs().max() > FP16_MAX

    model = on_dynamo(planted_mlp())
    replay_of(model, x)()    # the step that overflowed: .grad now holds its (non-finite) gradients
    before = snapshot(model)
    report = locate_overflow(model, replay_of(model, x))

    gm = dynamo_graph(model)   # the model compiled at its root: dynamo's graph names modules from it
    assert report.forward == {"part": "", "module": "layers.1.up", "node": the_node(gm, "layers.1.up", "linear"),
                              "op": "linear", "found": "node output", "value": "inf", "dtype": "float16"}
    # the inf reaches layers.1.down's weight gradient (relu of inf times the incoming gradient) and head's
    expected = [n for n, p in before[0].items() if p is not None and not torch.isfinite(p).all()]
    assert report.parameters == expected and "layers.1.down.weight" in expected
    text = str(report)
    assert text.startswith(f"fp16 step overflowed: forward value of node '{report.forward['node']}' "
                           "(layers.1.up, linear) became inf")
    assert 2 <= len(text.splitlines()) <= 4
    assert_unchanged(model, before)


def test_replay_leaves_grads_buffers_and_graphs_as_they_were():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.fill_(PLANTED * 100)
    on_dynamo(model)
    x = torch.randn(4, 8)
    replay_of(model, x)()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)   # the caller's own gradients, e.g. accumulated micro-batches
    before = snapshot(model)
    stats = [b.clone() for b in model.buffers()]
    graphs = dynamo_graphs(model)
    report = locate_overflow(model, replay_of(model, x))
    assert report is not None and report.forward["module"] == "2"
    assert_unchanged(model, before)
    # the graph counts the batch in place (num_batches_tracked): the replay's count is undone
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert dynamo_graphs(model) == graphs   # the same graphs, none made by the replay
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())   # zero cost after


def test_a_plain_loop_with_grad_scaler_records_where_its_skipped_step_overflowed():
    model = on_dynamo(planted_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0 ** 4)
    x = inputs()
    weights = [p.detach().clone() for p in model.parameters()]
    scale, rng = scaler.get_scale(), rng_state()
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_overflow and all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))

    def replay():   # the README's recipe: the step's scale and RNG state, the training's stream kept
        with replay_rng(rng):
            (model(x).sum() * scale).backward()

    report = scaler.record_overflow(locate_overflow(model, replay))
    assert scaler.last_overflow_report is report and report.forward["module"] == "layers.1.up"


def test_replay_rng_starts_from_the_steps_state_and_leaves_the_training_stream_as_it_was():
    # the one RNG fork every integration's replay runs under (Lightning, Trainer, Fabric, Accelerate)
    state = rng_state()
    step_draw = torch.rand(4)          # what the skipped step drew (dropout masks)
    stream = torch.get_rng_state()
    with replay_rng(state):
        assert torch.equal(torch.rand(4), step_draw)
    assert torch.equal(torch.get_rng_state(), stream)
    with replay_rng():                 # no state (Accelerate: the user's compute_loss): from where the stream is
        torch.rand(100)
    assert torch.equal(torch.get_rng_state(), stream)


class Wrapper(nn.Module):
    """A LightningModule-like holder: the model converted in place is one of its children."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.net(x) * self.scale


def test_a_converted_child_of_the_model_passed_reports_paths_in_the_outer_model():
    net = on_dynamo(planted_mlp())
    model = Wrapper(net)
    x = inputs()
    replay_of(model, x)()
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward == {"part": "net", "module": "net.layers.1.up",
                              "node": the_node(dynamo_graph(net), "layers.1.up", "linear"), "op": "linear",
                              "found": "node output", "value": "inf", "dtype": "float16"}
    assert "net.layers.1.down.weight" in report.parameters and report.precision == "fp16"


# --- (2) backward-only overflow -------------------------------------------------------------------------
def test_custom_function_with_an_inf_gradient_names_the_node_before_it():
    model = on_dynamo(Branchy("gradient"))
    x = inputs()
    replay_of(model, x)()
    report = locate_overflow(model, replay_of(model, x))
    # the branch breaks the graph: pre's graph returns h to it, the graph of the rest applies the Function (its
    # own node, whose output's gradient is still finite: post's) and post
    first, rest = dynamo_graphs(model)
    assert any(n.target is torch.ops.higher_order.autograd_function_apply for n in rest.graph.nodes)
    (returned,) = [n for n in first.graph.output_node().args[0] if module_of(n) == "pre"]   # h, not the branch's bool
    assert report.forward is None
    assert report.backward["part"] == "" and report.backward["module"] == "pre"
    assert report.backward["node"] == returned.name and report.backward["value"] == "inf"
    assert report.parameters == ["pre.weight", "pre.bias"]   # post's gradients come before the inf


# --- (3) modules run as written: module-level findings -------------------------------------------------
def test_a_module_run_as_written_is_named_at_module_granularity():
    # on dynamo a module runs as written when it is not compiled: here the root (its children compiled one by one,
    # as Lightning's plugin does) and amplify (no parameters, so not compiled)
    model = children_compiled(Branchy("module"))
    x = inputs()
    replay_of(model, x)()
    assert compiled_record(model.amplify) is None and dynamo_graphs(model.pre) and dynamo_graphs(model.post)
    with torch.no_grad():   # independently: pre's output is finite, Amplify's is not
        assert torch.isfinite(model.pre(x)).all() and not torch.isfinite(model.amplify(model.pre(x))).all()
    report = locate_overflow(model, replay_of(model, x))
    # "part" None: amplify is in no compiled module (the parts capture named the as-written root part "")
    assert report.forward == {"part": None, "module": "amplify", "node": None, "op": "Amplify",
                              "found": "module output", "value": "inf", "dtype": "float32"}
    assert "module 'amplify' (Amplify, run as written) became inf" in str(report)


def test_the_own_code_of_a_module_run_as_written_is_named_by_the_input_it_passes_on():
    model = children_compiled(Branchy("own code"))
    x = inputs()
    replay_of(model, x)()
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward["module"] == "" and report.forward["node"] is None and report.forward["part"] is None
    assert report.forward["op"] == "Branchy" and report.forward["found"] == "own code, before calling 'post'"
    assert "module '<model>' (Branchy, own code, before calling 'post') became inf" in str(report)


@pytest.mark.parametrize("plant", ["module", "own code"])
def test_compiled_at_its_root_code_after_a_graph_break_is_named_by_its_node(plant):
    # compiled at its root nothing runs as written: the code after the branch is the second graph's nodes. The
    # conversion computes the user's `.half() * 1e5` in fp32, so the inf is the cast into post's fp16 input
    model = on_dynamo(Branchy(plant))
    x = inputs()
    replay_of(model, x)()
    report = locate_overflow(model, replay_of(model, x))
    first, rest = dynamo_graphs(model)
    assert report.forward["part"] == "" and report.forward["node"] in {n.name for n in rest.graph.nodes}
    assert report.forward["op"] == "cast" and report.forward["value"] == "inf" \
        and report.forward["dtype"] == "float16"
    # the cast has amplify's module when amplify's code made its input; the root's own code has none: its reader's
    assert report.forward["module"] == ("amplify" if plant == "module" else "post")


def test_a_plain_module_gets_module_hooks():
    torch.manual_seed(0)
    model = MLP()    # not converted: fp32, planted past fp32's range
    with torch.no_grad():
        model.layers[1].up.weight.fill_(1e38)
    x = inputs()
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward == {"part": None, "module": "layers.1.up", "node": None, "op": "Linear",
                              "found": "module output", "value": "inf", "dtype": "float32"}
    assert report.precision == "mixed-precision"


# --- (4) a clean step -----------------------------------------------------------------------------------
def test_a_clean_step_reports_nothing_and_changes_nothing():
    torch.manual_seed(0)
    model = on_dynamo(MLP())
    x = torch.randn(2, 8)
    replay_of(model, x)()
    before = snapshot(model)
    assert locate_overflow(model, replay_of(model, x)) is None
    assert_unchanged(model, before)


# --- (5) a GraphModule from convert() --------------------------------------------------------------------
def test_a_graph_module_from_convert_names_its_node():
    gm = amp_compiler.convert(planted_mlp())
    x = inputs()
    expected = gm(x)
    before = snapshot(gm)
    report = locate_overflow(gm, replay_of(gm, x))
    assert report.forward == {"part": None, "module": "layers.1.up", "node": the_node(gm, "layers.1.up", "linear"),
                              "op": "linear", "found": "node output", "value": "inf", "dtype": "float16"}
    assert_unchanged(gm, before)
    assert torch.equal(gm(x).nan_to_num(), expected.nan_to_num())   # the compiled forward is back


class Masked(nn.Module):
    """Causal attention with a -inf mask (an intended infinity), then the planted Linear."""

    def __init__(self):
        super().__init__()
        self.v = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        scores = x @ x.transpose(-1, -2)
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.out(attention @ self.v(x))


def test_an_intended_minus_inf_mask_is_not_the_overflow(monkeypatch):
    torch.manual_seed(0)
    model = Masked()
    with torch.no_grad():
        model.v.weight.fill_(0.5)              # v(x) > 0 for x > 0: out's inputs are about 6
        model.out.weight.fill_(PLANTED * 10)   # 8 * 6 * 10000 > FP16_MAX
    gm = amp_compiler.convert(model)
    x = torch.rand(3, 8) + 1
    report = locate_overflow(gm, replay_of(gm, x))
    assert report.forward["node"] == the_node(gm, "out", "linear")
    # without the rule for constant infinities the mask would be named: the rule is what skips it
    monkeypatch.setattr(overflow_report, "_has_infinite_constant", lambda node: False)
    assert locate_overflow(gm, replay_of(gm, x)).forward["node"] == the_node(gm, "", "masked_fill")


# --- robustness ---------------------------------------------------------------------------------------
def test_a_failing_check_reports_what_was_found_and_restores_the_model(monkeypatch):
    model = on_dynamo(planted_mlp())
    x = inputs()
    replay_of(model, x)()
    before = snapshot(model)
    calls = []
    real = overflow_report._non_finite

    def failing_after_the_overflow(values):
        calls.append(1)
        found = real(values)
        if found[0] is not None:
            monkeypatch.setattr(overflow_report, "_non_finite", _broken)
        return found

    monkeypatch.setattr(overflow_report, "_non_finite", failing_after_the_overflow)
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward["module"] == "layers.1.up"
    assert report.note.startswith("the checks stopped early (RuntimeError: broken check")
    assert "note: the checks stopped early" in str(report)
    assert_unchanged(model, before)


def _broken(values):
    raise RuntimeError("broken check")


def test_a_replay_that_raises_is_reported_not_raised():
    model = on_dynamo(planted_mlp())
    x = inputs()
    model(x)

    def replay():
        model(x)
        raise ValueError("loader exhausted")

    report = locate_overflow(model, replay)
    assert report.forward["module"] == "layers.1.up"
    assert report.note == "the replay raised ValueError: loader exhausted"
    assert "forward" not in dynamo_graph(model).__dict__


# --- (6) the scalers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [DynamicLossScaleManager, FixedLossScaleManager, lambda: GradScaler("cpu")])
def test_scalers_keep_the_last_overflow_report(make):
    scaler = make()
    assert scaler.last_overflow_report is None
    report = OverflowReport(forward=None, backward=None, parameters=["w"])
    assert scaler.record_overflow(report) is report
    assert scaler.last_overflow_report is report
    assert "last_overflow_report" not in scaler.state_dict()   # a log item, not checkpoint state
    assert scaler.record_overflow(None) is None and scaler.last_overflow_report is None


@pytest.mark.slow
@pytest.mark.real_models
@pytest.mark.parametrize("capture", ["dynamo"])
def test_a_tiny_llama_converted_in_place_names_its_mlp_projection(capture):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = amp_compiler.convert(LlamaForCausalLM(config).train(), "O1", dtype=torch.float16, inplace=True,
                                 capture=capture)
    ids = torch.randint(0, 128, (2, 8))

    def replay():
        model(input_ids=ids, labels=ids).loss.backward()

    replay()
    assert locate_overflow(model, replay) is None   # its masks and softmaxes are no overflow
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.fill_(5000.0)
    report = locate_overflow(model, replay)
    # a call with labels is one graph, of the model compiled at its root (part "")
    gm = dynamo_graph(model)
    node = report.forward.pop("node")
    assert report.forward == {"part": "", "module": "model.layers.1.mlp.up_proj",
                              "op": "linear", "found": "node output", "value": "inf", "dtype": "float16"}
    assert node in {n.name for n in gm.graph.nodes}
    assert "model.layers.1.mlp.up_proj.weight" in report.parameters


# --- on TorchDynamo's capture ---------------------------------------------------------------------------
def test_on_dynamo_forward_overflow_names_the_graph_node_and_its_module_path_without_a_recompile():
    model = on_dynamo(planted_mlp())
    x = inputs()
    model(x).sum().backward()   # the step that overflowed: its graph is captured
    model.zero_grad(set_to_none=True)
    gm = dynamo_graph(model)
    before = {n: p.grad for n, p in model.named_parameters()}
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward == {"part": "", "module": "layers.1.up", "node": the_node(gm, "layers.1.up", "linear"),
                              "op": "linear", "found": "node output", "value": "inf", "dtype": "float16"}
    assert "layers.1.down.weight" in report.parameters and report.precision == "fp16"
    assert dynamo_graphs(model) == [gm]   # the replay compiled nothing more: no hook inside the compiled forward
    assert "forward" not in gm.__dict__ and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert {n: p.grad for n, p in model.named_parameters()} == before


def test_on_dynamo_backward_only_overflow_names_the_node_nearest_the_loss():
    torch.manual_seed(0)
    model = on_dynamo(MLP())
    x, scale = torch.randn(2, 8), 1e30
    assert torch.isfinite(model(x)).all()
    report = locate_overflow(model, replay_of(model, x, scale))
    gm = dynamo_graph(model)
    assert report.forward is None
    head = the_node(gm, "head", "linear")
    assert report.backward == {"part": "", "module": "head", "node": head, "op": "linear", "found": "node output",
                               "value": "inf", "dtype": "float16"}
    assert "forward value stayed finite" in str(report) and f"node '{head}' (head, linear), inf" in str(report)
    assert report.parameters   # the scaled gradients are non-finite too


def test_on_dynamo_a_non_finite_batch_is_named_as_the_model_input():
    model = on_dynamo(MLP())
    x = torch.full((2, 8), float("nan"))
    model(torch.randn(2, 8))
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward == {"part": "", "module": "", "node": None, "op": "MLP", "found": "model input",
                              "value": "nan", "dtype": "float32"}
    assert str(report).startswith("fp16 step overflowed: the input of module '<model>' (MLP) was nan already "
                                  "(model input: check the batch)")


@pytest.mark.parametrize("first_call", [True, False], ids=["first call", "recompile"])
def test_on_dynamo_a_graph_made_during_the_replay_is_checked_node_by_node(first_call):
    model = on_dynamo(planted_mlp())
    x = inputs()
    if not first_call:   # a graph for evaluation: dynamo guards on the flags, the replay's training call recompiles
        with torch.no_grad():
            model.eval()(x)
        model.train()
    graphs_before = len(dynamo_graphs(model))
    report = locate_overflow(model, replay_of(model, x))
    assert len(dynamo_graphs(model)) == graphs_before + 1
    made = dynamo_graphs(model)[-1]   # the graph the replay's call made
    assert report.forward == {"part": "", "module": "layers.1.up",
                              "node": the_node(made, "layers.1.up", "linear"), "op": "linear",
                              "found": "node output", "value": "inf", "dtype": "float16"}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_on_dynamo_a_weights_cast_is_not_named_as_the_first_non_finite_gradient():
    model = on_dynamo(planted_mlp())
    x = inputs()
    model(x)
    report = locate_overflow(model, replay_of(model, x))
    assert report.forward["module"] == "layers.1.up" and "head.weight" in report.parameters
    if report.backward is not None:   # a node's output, not a weight's cast (dynamo passes weights as placeholders)
        gm = dynamo_graph(model)
        weights = {name for name, given in gm.meta["amp"]["graph_inputs"].items() if given.get("kind") == "parameter"}
        node = next(n for n in gm.graph.nodes if n.name == report.backward["node"])
        assert not weights & {n.name for n in node.all_input_nodes}, node.format_node()

