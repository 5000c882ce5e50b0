"""fx/aliases.py: what an in-place op writes and the views it writes through, down to the base."""
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.aliases import written_value, written_views
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.rules import PrecisionRules


class Writes(nn.Module):
    def forward(self, x):
        h = x.relu()
        v = h[:, :4].transpose(0, 1)
        v.mul_(2)                 # through two views into h
        y = h.exp()
        y.add_(1)                 # into y itself
        return h * 2 + y, x.sigmoid()


def classified() -> dict[str, fx.Node]:
    gm = fx.symbolic_trace(Writes())
    canonicalize(gm)
    rules = PrecisionRules.build("O1", "float16")
    for node in gm.graph.nodes:   # the family decide_precision writes
        facts(node)["family"] = rules.classify(facts(node)["op"])[1]
    return {n.name: n for n in gm.graph.nodes}


def test_a_write_through_views_reaches_its_base_and_stops_there():
    nodes = classified()
    assert written_value(nodes["mul_"]) is nodes["transpose"]
    assert written_views(nodes["mul_"]) == [nodes["transpose"], nodes["getitem"], nodes["relu"]]   # not x


def test_a_write_into_a_computed_value_is_that_value_alone():
    nodes = classified()
    assert written_views(nodes["add_"]) == [nodes["exp"]]


def test_an_out_of_place_op_writes_nothing():
    nodes = classified()
    for name in ("relu", "getitem", "transpose", "mul", "sigmoid"):
        assert written_value(nodes[name]) is None and written_views(nodes[name]) == [], name
