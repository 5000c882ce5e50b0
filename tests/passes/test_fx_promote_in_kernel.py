"""fx/promote_in_kernel.py on hand-built graphs: an fp32 add/sub/mul/div beside a dimensioned fp32 tensor
reads its low operand uncast (bitwise the same result); where promotion would not give fp32 the cast stays."""
import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.insert_casts import make_cast
from amp_compiler.passes.fx.promote_in_kernel import promote_in_kernel
from amp_compiler.passes.fx.runtime import is_cast
from amp_compiler.passes.node_facts import facts

BF16, F32 = torch.bfloat16, torch.float32


def residual(partner_shape=(4,), op=operator.add, name="add", inplace=False, cast_partner=False, low=BF16):
    """h (low) upcast, then `op` with r (fp32, a fake value of `partner_shape`)."""
    g = fx.Graph()
    h, r = g.placeholder("h"), g.placeholder("r")
    h.meta["amp"], r.meta["amp"] = {"dtype": low}, {"dtype": F32}
    r.meta["val"] = torch.empty(partner_shape)
    up = make_cast(g, h, F32, "boundary")
    other = r
    if cast_partner:
        r.meta["amp"]["dtype"] = low
        other = make_cast(g, r, F32, "boundary")
        other.meta["val"] = torch.empty(partner_shape)
    out = g.call_function(op, (up, other))
    out.meta["amp"] = {"op": name, "dtype": F32, "precision": "fp32", "rule": "deny: forced", "inplace": inplace}
    g.output(out)
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("op,name", [(operator.add, "add"), (operator.sub, "sub"), (operator.mul, "mul"),
                                     (operator.truediv, "div")])
def test_the_op_reads_the_low_value_and_the_result_is_bitwise_the_same(op, name):
    gm = residual(op=op, name=name)
    h, r = torch.randn(3, 4).bfloat16(), torch.randn(4)
    gm.recompile()
    before = gm(h, r)
    result = promote_in_kernel(gm)
    assert result.modified and result.counts == {"upcasts_left_to_the_kernel": 1}
    out = next(n for n in gm.graph.nodes if facts(n).get("op") == name)
    assert [a.name for a in out.all_input_nodes] == ["h", "r"]
    assert not any(is_cast(n) for n in gm.graph.nodes)   # the dead cast is erased
    assert facts(out)["rule"] == "deny: forced; reads h uncast (type promotion)"
    gm.graph.lint()
    gm.recompile()
    after = gm(h, r)
    assert after.dtype == F32 and torch.equal(after, before)


@pytest.mark.parametrize("case", [
    dict(partner_shape=()),             # a 0-dim fp32 tensor loses promotion to a dimensioned bf16 one
    dict(inplace=True),                 # an in-place op writes its first operand in its dtype
    dict(cast_partner=True),            # two upcasts: one must stay for the result to be fp32
    dict(low=torch.float64),            # not a low source
    dict(op=torch.maximum, name="maximum"),   # no promoting op
], ids=["0-dim", "inplace", "both-cast", "fp64-source", "maximum"])
def test_where_promotion_would_not_give_fp32_the_cast_stays(case):
    gm = residual(**case)
    code = gm.graph.python_code("self").src
    result = promote_in_kernel(gm)
    assert not result.modified and result.counts == {"upcasts_left_to_the_kernel": 0}
    assert gm.graph.python_code("self").src == code
