"""fx/cast_after_layout_ops.py on hand-built graphs: a cast read by a transpose moves after it and writes the
transposed value row-major; a channels-last permute read by no matmul keeps its cast; a transposed low input of
3+ dims into a matmul gets a row-major copy."""
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.passes.fx.cast_after_layout_ops import cast_after_layout_ops
from amp_compiler.passes.fx.insert_casts import make_cast
from amp_compiler.passes.fx.runtime import amp_cast, is_cast
from amp_compiler.passes.node_facts import facts

BF16, F32 = torch.bfloat16, torch.float32


def node(graph, target, args, op, dtype, precision=None, kind="call_function"):
    made = graph.call_function(target, args) if kind == "call_function" else graph.call_method(target, args)
    made.meta["amp"] = {"op": op, "dtype": dtype, "precision": precision}
    return made


def placeholder(graph, name, dtype):
    made = graph.placeholder(name)
    made.meta["amp"] = {"op": "placeholder", "dtype": dtype}
    return made


def cast_then_transpose_then_linear():
    g = fx.Graph()
    x, w = placeholder(g, "x", F32), placeholder(g, "w", BF16)
    low = make_cast(g, x, BF16, "boundary")
    t = node(g, torch.transpose, (low, 0, 1), "transpose", BF16, "low")
    g.output(node(g, F.linear, (t, w), "linear", BF16, "low"))
    return fx.GraphModule(nn.Module(), g)


def test_the_cast_moves_after_the_transpose_and_writes_it_row_major():
    gm = cast_then_transpose_then_linear()
    x, w = torch.randn(5, 3), torch.randn(4, 5).bfloat16()
    gm.recompile()
    before = gm(x, w)
    result = cast_after_layout_ops(gm)
    gm.graph.lint()
    gm.recompile()
    assert result.modified and result.counts == {"casts_moved_after_layout_ops": 1, "contiguous_copies": 0}
    linear = next(n for n in gm.graph.nodes if facts(n).get("op") == "linear")
    cast = linear.args[0]
    assert is_cast(cast) and cast.kwargs == {"contiguous": True} and cast.meta["amp_role"] == "cast"
    transpose = cast.args[0]
    assert facts(transpose)["op"] == "transpose" and transpose.args[0].name == "x"   # the view of the fp32 value
    assert facts(transpose)["dtype"] == F32 and facts(transpose)["precision"] is None
    assert sum(is_cast(n) for n in gm.graph.nodes) == 1   # the old cast is gone
    assert torch.equal(gm(x, w), before)
    assert amp_cast(x.t(), BF16, contiguous=True).is_contiguous()   # what the moved cast writes


def channels_last(reader_op, reader):
    g = fx.Graph()
    x, w = placeholder(g, "x", F32), placeholder(g, "w", BF16)
    low = make_cast(g, x, BF16, "boundary")
    p = node(g, "permute", (low, 0, 3, 1, 2), "permute", BF16, "low", kind="call_method")
    g.output(node(g, reader, (p, w), reader_op, BF16, "low"))
    return fx.GraphModule(nn.Module(), g)


def test_a_channels_last_permute_into_a_conv_keeps_its_cast_before_it():
    gm = channels_last("conv2d", F.conv2d)
    code = gm.graph.python_code("self").src
    result = cast_after_layout_ops(gm)
    assert not result.modified and result.counts == {"casts_moved_after_layout_ops": 0, "contiguous_copies": 0}
    assert gm.graph.python_code("self").src == code


def test_the_same_permute_into_a_matmul_moves():
    assert cast_after_layout_ops(channels_last("matmul", torch.matmul)).counts["casts_moved_after_layout_ops"] == 1


def test_a_cast_read_by_no_layout_op_is_left_alone():
    g = fx.Graph()
    x, w = placeholder(g, "x", F32), placeholder(g, "w", BF16)
    g.output(node(g, F.linear, (make_cast(g, x, BF16, "boundary"), w), "linear", BF16, "low"))
    gm = fx.GraphModule(nn.Module(), g)
    code = gm.graph.python_code("self").src
    assert not cast_after_layout_ops(gm).modified and gm.graph.python_code("self").src == code


def low_transpose_into_linear(dims):
    g = fx.Graph()
    x, w = placeholder(g, "x", BF16), placeholder(g, "w", BF16)
    t = node(g, torch.transpose, (x, -1, -2), "transpose", BF16, "low")
    t.meta["val"] = torch.empty(*dims, dtype=BF16).transpose(-1, -2)
    g.output(node(g, F.linear, (t, w), "linear", BF16, "low"))
    return fx.GraphModule(nn.Module(), g)


def test_a_transposed_low_input_of_three_dims_gets_a_row_major_copy_before_the_matmul():
    gm = low_transpose_into_linear((2, 5, 3))
    result = cast_after_layout_ops(gm)
    assert result.counts == {"casts_moved_after_layout_ops": 0, "contiguous_copies": 1}
    linear = next(n for n in gm.graph.nodes if facts(n).get("op") == "linear")
    copy = linear.args[0]
    assert copy.op == "call_method" and copy.target == "contiguous" and facts(copy.args[0])["op"] == "transpose"
    gm.recompile()
    x, w = torch.randn(2, 5, 3).bfloat16(), torch.randn(4, 5).bfloat16()
    assert torch.equal(gm(x, w), F.linear(x.transpose(-1, -2), w))


def test_a_two_dim_transposed_input_gets_no_copy():
    gm = low_transpose_into_linear((5, 3))
    assert not cast_after_layout_ops(gm).modified
