"""insert_casts and fold_casts on their own: structure, counts, validity; where cast_after_layout_ops moves a cast."""
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.fold_casts import count_casts, fold_casts
from amp_compiler.passes.fx.insert_casts import insert_casts, make_cast
from amp_compiler.passes.fx.runtime import amp_cast


def graph_with(dtypes: dict, build) -> fx.GraphModule:
    """A GraphModule built by `build(graph)`, with meta["amp"]["dtype"] set from `dtypes` by node name."""
    graph = fx.Graph()
    build(graph)
    for node in graph.nodes:
        node.meta.setdefault("amp", {})["dtype"] = dtypes.get(node.name)
    return fx.GraphModule(nn.Module(), graph)


def test_one_shared_cast_per_value_and_dtype():
    def build(g):
        x = g.placeholder("x")
        a = g.call_function(torch.relu, (x,), name="a")
        b = g.call_function(torch.tanh, (x,), name="b")
        c = g.call_function(torch.softmax, (x, -1), name="c")
        g.output((a, b, c))

    gm = graph_with({"x": torch.float32, "a": torch.float16, "b": torch.float16, "c": torch.float32}, build)
    for name, precision in (("a", "low"), ("b", "low"), ("c", "fp32")):
        next(n for n in gm.graph.nodes if n.name == name).meta["amp"]["precision"] = precision
    result = insert_casts(gm, torch.float16, [torch.float32] * 3, keep_io_types=True)
    assert result.counts == {"casts_inserted": 3} and result.modified  # x->f16 (shared), a->f32, b->f32
    x_casts = [n for n in gm.graph.nodes if n.target is amp_cast and n.args[0].name == "x"]
    assert len(x_casts) == 1 and {u.name for u in x_casts[0].users} == {"a", "b"}
    gm.graph.lint()
    gm.recompile()
    a, b, c = gm(torch.randn(2, 3))
    assert a.dtype == b.dtype == c.dtype == torch.float32


def test_without_keep_io_types_outputs_stay_low():
    def build(g):
        x = g.placeholder("x")
        g.output(g.call_function(torch.relu, (x,), name="a"))

    gm = graph_with({"x": torch.float32, "a": torch.float16}, build)
    next(n for n in gm.graph.nodes if n.name == "a").meta["amp"]["precision"] = "low"
    assert insert_casts(gm, torch.float16, [torch.float32], keep_io_types=False).counts["casts_inserted"] == 1
    gm.recompile()
    assert gm(torch.randn(3)).dtype == torch.float16


def test_fold_removes_chains_no_ops_duplicates_and_dead_casts():
    dtypes = {"x": torch.float32, "h": torch.float16}

    def build(g):
        x = g.placeholder("x")
        h = g.call_function(torch.relu, (x,), name="h")
        down = make_cast(g, x, torch.float16, "test")
        back = make_cast(g, down, torch.float32, "test")          # fp32 -> f16 -> fp32 chain
        same = make_cast(g, h, torch.float16, "test")             # to the dtype h already has
        dup1, dup2 = make_cast(g, h, torch.float32, "t"), make_cast(g, h, torch.float32, "t")
        make_cast(g, x, torch.bfloat16, "dead")                   # nobody reads it
        g.output((back, same, dup1, dup2))

    gm = graph_with(dtypes, build)
    for node in gm.graph.nodes:
        if node.target is amp_cast:
            node.meta["amp"]["dtype"] = node.args[1]
    result = fold_casts(gm)
    gm.graph.lint()
    gm.recompile()
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert output[0].name == "x"           # the chain reads the exact fp32 original
    assert output[1].name == "h"           # no-op cast gone
    assert output[2] is output[3]          # duplicates merged
    assert count_casts(gm) == 1 and result.counts["casts_removed"] == 5  # + the chain's now-dead first cast
    x = torch.randn(4)
    back, same, dup, _ = gm(x)
    assert torch.equal(back, x) and dup.dtype == torch.float32


def test_amp_cast_touches_only_castable_floats():
    assert amp_cast(torch.ones(2), torch.float16).dtype == torch.float16
    for value in (torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64), torch.ones(2) > 0):
        assert amp_cast(value, torch.float16) is value
    nested = amp_cast((torch.ones(1), [torch.ones(1, dtype=torch.int32)], 3), torch.bfloat16)
    assert nested[0].dtype == torch.bfloat16 and nested[1][0].dtype == torch.int32 and nested[2] == 3


class TiedWeights(nn.Module):
    """`b` shares `a`'s weight, `head` the embedding's; `a` runs twice (a shared block)."""

    def __init__(self):
        super().__init__()
        self.emb, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.b.weight, self.head.weight = self.a.weight, self.emb.weight

    def forward(self, tokens):
        x = self.a(torch.relu(self.b(self.a(self.emb(tokens)))))
        return self.head(x + torch.nn.functional.linear(x, self.b.weight))


def test_a_weight_read_under_several_names_or_by_several_calls_is_cast_once():
    import operator

    import amp_compiler
    from amp_testing import AtenDtypeRecorder
    model, tokens = TiedWeights(), torch.randint(0, 10, (2, 5))
    for example_inputs in (None, (tokens,)):
        gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=example_inputs)
        weight_casts = [operator.attrgetter(c.args[0].target)(gm) for c in gm.graph.nodes
                        if c.target is amp_cast and c.args[0].op == "get_attr"]
        assert len(weight_casts) == len({id(w) for w in weight_casts}) == 4   # a.weight, a.bias, b.bias, head
        gm.graph.lint()
        with AtenDtypeRecorder() as recorder:
            out = gm(tokens)
        assert len(recorder.calls["_to_copy"]) == 6   # the 4 weights, the embedding's output, the output to fp32
        assert torch.allclose(out, model(tokens), rtol=0.05, atol=0.05 * model(tokens).abs().max().item())


class ChannelsLastNorm(nn.Module):
    """timm's LayerNorm2d between two convolutions: NCHW -> NHWC, an fp32 norm, back to NCHW (a channels-last
    view); with `matmul_after`, a linear over the last dim reads the permuted value instead."""

    def __init__(self, matmul_after: bool = False):
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.LayerNorm(8), nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(6, 6) if matmul_after else None

    def forward(self, x):
        y = self.norm(self.conv1(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.fc(y) if self.fc is not None else self.conv2(y)


def _first_inputs_of(names: tuple, gm, x) -> list:
    """The first tensor argument of every aten op in `names` that running gm(x) calls."""
    seen = []

    class Inputs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in names:
                seen.append(args[0] if func.overloadpacket.__name__ != "addmm" else args[1])
            return func(*args, **(kwargs or {}))

    with Inputs():
        gm(x)
    return seen


def test_a_permute_back_to_channels_first_stays_after_its_cast_unless_a_matmul_reads_it():
    import amp_compiler
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6)
    model = ChannelsLastNorm().eval()
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.meta["amp"]["pass_counts"]["cast_after_layout_ops"].get("casts_moved_after_layout_ops", 0) == 0
    assert not [n for n in gm.graph.nodes if n.target is amp_cast and n.kwargs.get("contiguous")]
    second_conv_input = _first_inputs_of(("convolution",), gm, x)[1]   # a straight copy: still channels-last
    assert second_conv_input.dtype == torch.bfloat16 and not second_conv_input.is_contiguous()
    assert second_conv_input.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(gm(x), model(x), rtol=0.05, atol=0.05 * model(x).abs().max().item())

    model = ChannelsLastNorm(matmul_after=True).eval()       # a matmul reads it: the cast writes row-major
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    assert gm.meta["amp"]["pass_counts"]["cast_after_layout_ops"]["casts_moved_after_layout_ops"] == 1
    assert all(t.is_contiguous() for t in _first_inputs_of(("addmm", "mm", "bmm", "linear", "matmul"), gm, x))
    assert torch.allclose(gm(x), model(x), rtol=0.05, atol=0.05 * model(x).abs().max().item())
