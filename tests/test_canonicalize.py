"""One canonical op for every spelling: modules, functions, methods, operators, ATen overloads."""
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.frontend import trace
from amp_compiler.passes.fx.canonicalize import canonical_op, canonicalize


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        a = self.fc(x)                       # module
        b = F.linear(x, self.fc.weight)      # torch.nn.functional
        c = torch.softmax(a, -1)             # torch function
        d = b.softmax(-1)                    # Tensor method
        e = a @ b.t()                        # operator
        f = F.layer_norm(c, (4,)) + self.norm(d)
        return (e.sum() / 2) * f


def ops_of(gm):
    canonicalize(gm)
    return [n.meta["amp"]["op"] for n in gm.graph.nodes]


def test_symbolic_trace_spellings_share_names():
    ops = ops_of(trace(Spellings()).graph_module)
    assert ops.count("linear") == 2 and ops.count("softmax") == 2 and ops.count("layer_norm") == 2
    assert {"matmul", "t", "add", "sum", "div", "mul", "placeholder", "output", "get_attr"} <= set(ops)


def test_aten_overloads_map_to_the_same_names():
    gm = torch.export.export(Spellings(), (torch.randn(2, 4),)).module()
    ops = set(ops_of(gm))
    assert {"linear", "softmax", "layer_norm", "matmul", "sum", "div", "mul", "add"} <= ops


def test_unknown_module_keeps_its_class_name():
    class Custom(nn.Module):
        def forward(self, x):
            return x

    root = nn.ModuleDict({"c": Custom()})
    graph = fx.Graph()
    node = graph.call_module("c", (graph.placeholder("x"),))
    assert canonical_op(node, root) == "module:Custom"
    assert canonical_op(graph.call_function(operator.truediv, (1, 2)), root) == "div"
