"""convert(): where casts go: once per value and dtype, never on ints/bools/fp64, never across an in-place write; constants fp16 cannot hold."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_compiler import convert, explain
from amp_testing import assert_close_to_fp32, cast_nodes


def test_parameters_are_cast_where_read_once_per_forward():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return (x @ self.w) @ self.w

    gm = convert(Tied(), "O1")
    param_casts = [c for c in cast_nodes(gm) if c.args[0].op == "get_attr"]
    assert len(param_casts) == 1 and len(param_casts[0].users) == 2


def test_integer_bool_and_fp64_values_are_never_cast():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(4, 4, dtype=torch.float64))

        def forward(self, ids, mask):
            h = self.fc(self.emb(ids))
            h = h.masked_fill(mask.unsqueeze(-1), 0.0)
            return h, self.table @ self.table, ids + 1

    ids, mask = torch.randint(0, 10, (2, 3)), torch.rand(2, 3) > 0.5
    gm = convert(Mixed(), "O1", example_inputs=(ids, mask))
    for cast in cast_nodes(gm):
        assert cast.args[0].meta["amp"]["dtype"] in (torch.float32, torch.float16, torch.bfloat16)
    out, table, ids_out = gm(ids, mask)
    assert table.dtype == torch.float64 and ids_out.dtype == torch.int64 and out.dtype == torch.float32
    fp64_rows = [r for r in explain(gm).rows if r["op"] == "matmul"]
    assert fp64_rows and all(r["dtype"] == "-" for r in fp64_rows)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        before = self.fc2(h)          # reads h before the in-place write
        h.mul_(2)                     # writes h: must not write a cast copy
        after = torch.softmax(h, -1)  # fp32 reader after the write: a fresh cast
        return before, after, F.relu(self.fc2(after), inplace=True)


def test_in_place_ops_write_the_real_tensor_and_casts_are_not_reused_across_writes():
    model = InPlace()
    x = torch.randn(3, 4)
    gm = convert(model, "O1")
    rows = {r["node"]: r for r in explain(gm).rows}
    assert rows["mul_"]["rule"].startswith("in-place op")
    mul = next(n for n in gm.graph.nodes if n.name == "mul_")
    assert mul.args[0].op == "call_function" and mul.args[0].meta["amp"]["op"] == "linear"  # not a cast
    with torch.no_grad():
        for out, ref in zip(gm(x), model(x)):
            assert_close_to_fp32(out, ref, torch.float16)


def test_a_module_called_twice_has_its_weights_cast_once():
    gm = convert(InPlace(), "O1")
    weight_casts = [c for c in cast_nodes(gm) if c.args[0].op == "get_attr" and c.args[0].target == "fc2.weight"]
    assert len(weight_casts) == 1 and len(weight_casts[0].users) == 2


class WriteAfterRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = x.softmax(-1)
        y = self.a(h)        # reads h cast to fp16 before the write
        h.mul_(100.0)
        return y, self.b(h)  # must read a fresh cast of the written h


def test_cast_clean_up_does_not_merge_casts_across_an_in_place_write():
    model, x = WriteAfterRead(), torch.randn(2, 4)
    gm = convert(model, "O1")
    softmax_casts = [c for c in cast_nodes(gm) if c.args[0].name == "softmax"]
    assert len(softmax_casts) == 2
    with torch.no_grad():
        for out, ref in zip(gm(x), model(x)):
            assert_close_to_fp32(out, ref, torch.float16)


def test_dict_inputs_are_cast_inside_the_dict():
    class TakesDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch):
            return self.fc(batch["x"])

    model, batch = TakesDict(), {"x": torch.randn(2, 4)}
    assert_close_to_fp32(convert(model, "O1")(batch), model(batch), torch.float16)


class MaskedScores(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(-1, -2)
        return scores.masked_fill(mask == 0, -1e9).softmax(-1)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])


def test_constants_beyond_fp16_range_keep_their_op_fp32(level):
    model, x, mask = MaskedScores(), torch.randn(2, 3, 4), torch.rand(2, 3, 3) > 0.3
    gm = convert(model, level)
    assert_close_to_fp32(gm(x, mask), model(x, mask), torch.float16)
    rule = next(r["rule"] for r in explain(gm).rows if r["op"] == "masked_fill")
    assert "-1e+09, beyond fp16's 65504" in rule
    bf16 = convert(model, level, dtype=torch.bfloat16)  # bf16 holds 1e9: no need to keep it fp32
    assert next(r["dtype"] for r in explain(bf16).rows if r["op"] == "masked_fill") == "bfloat16"


def test_float_floor_divide_keeps_the_output_dtype():
    class FloorDiv(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return (self.fc(x) // 0.5).relu()

    assert convert(FloorDiv(), "O1")(torch.randn(2, 4)).dtype == torch.float32


class WriteThroughView(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.softmax(x, dim=-1)
        v = h.view(5, 8)[:, :4]          # a view of a view of h, written in place and read by a low op
        v.mul_(100)
        return self.lin(v).sum() + h.sum()


@pytest.mark.parametrize("placement", [True, False])
def test_a_write_through_a_view_reaches_its_base(placement):
    # Casting h (or the view) before the write would put the write on a copy: h.sum() would miss it
    # (the result was -26.3 against fp32's 82.6 before views written in place were set aside).
    torch.manual_seed(0)
    model, x = WriteThroughView(), torch.randn(5, 8) * 3
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), cast_placement=placement)
    expected = model(x)
    assert abs(gm(x) - expected) < 0.01 * abs(expected)
    rules = {n.name: n.meta["amp"].get("reason", "") for n in gm.graph.nodes}
    assert "a view written in place by mul_" in rules["getitem"] and "a view written in place" in rules["view"]


class RelativePositionAttention(nn.Module):
    """As timm MViTv2's attention: relative-position terms written into the logits through a view
    (attn[:, :, 1:, 1:] = ...), then the softmax reads the whole tensor. Here the logits are also read in
    fp32 before the write (a logsumexp, denied), so their fp32 cast exists before the write."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.rel = nn.Parameter(torch.randn(4, 8) * 2)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = q.unsqueeze(1) @ k.unsqueeze(1).transpose(-1, -2)
        rel = torch.einsum("bhqc,kc->bhqk", q[:, None, 1:], self.rel)
        inner = attn[:, :, 1:, 1:]
        attn[:, :, 1:, 1:] = inner - inner.logsumexp(-1, keepdim=True) + rel
        return attn.softmax(dim=-1) @ v.unsqueeze(1)


@pytest.mark.slow
@pytest.mark.parametrize("placement", [True, False])
def test_a_cast_made_before_a_write_through_a_view_is_not_read_after_it(placement):
    """issue 17 (timm mvitv2_tiny, 2.7x autocast's error): the logits' fp32 cast made for the read before
    the write was reused by the softmax after it (fold_casts counted writes to the view, not to its base),
    so the relative-position terms never reached the softmax."""
    torch.manual_seed(0)
    model, x = RelativePositionAttention(), torch.randn(3, 5, 8)
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), cast_placement=placement)
    with torch.no_grad():
        expected, ours = model(x), gm(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x).float()
    assert (ours - expected).abs().max() <= max(2 * (autocast - expected).abs().max(), 2 ** -8 * expected.abs().max())


def test_an_in_place_activation_does_not_cut_a_low_chain():
    # conv -> bn -> relu_ -> pool -> conv: relu_ is set aside (it runs in the dtype it writes), but its value
    # flows on, so the norm and the pool paint as if it were out of place: no cast pair around them
    # (torchvision EfficientNet-B0 at O1 bf16: 151 runtime casts -> 117, autocast 116).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU(inplace=True),
                          nn.AdaptiveAvgPool2d(2), nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1)).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    painted = {n.meta["amp"]["op"]: n.meta["amp"].get("precision") for n in gm.graph.nodes if "amp" in n.meta}
    assert painted["batch_norm"] == painted["adaptive_avg_pool2d"] == "low"
    activations = [n for n in cast_nodes(gm) if n.args[0].op not in ("get_attr", "placeholder")]
    assert len(activations) == 1                      # only the output back to fp32
    assert_close_to_fp32(gm(x), model(x), torch.bfloat16)
