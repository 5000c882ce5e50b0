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


def test_logic_operators_and_assertions_have_the_names_the_policy_table_knows():
    """issue 17: operator.and_ was named "and" and aten.__and__ "and__", neither in the table (unknown:
    kept fp32, an island of its own); torch.export's shape assertions and fx's concrete-argument check too."""
    from amp_compiler.passes.policy.op_policy import POLICY

    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    targets = {operator.and_: "and_", operator.or_: "or_", operator.iand: "and_", torch.ops.aten.__and__.Tensor: "and_",
               torch.ops.aten.__or__.Tensor: "or_", torch.ops.aten.__xor__.Tensor: "xor",
               torch.ops.aten._assert_tensor_metadata.default: "assert_tensor_metadata",
               torch.ops.aten._assert_scalar.default: "assert_scalar",
               torch.ops.aten.sym_constrain_range_for_size.default: "sym_constrain_range_for_size",
               torch.ops.aten.diff.default: "diff", torch._assert: "assert", torch.sym_min: "sym_min"}
    nodes = {graph.call_function(target, (x, y)): name for target, name in targets.items()}
    root = nn.Module()
    for node, name in nodes.items():
        assert canonical_op(node, root) == name and POLICY[name].op_class in ("ignore", "infer"), node.target


def test_the_concrete_argument_check_fx_records_keeps_its_name():
    """fx records `_assert_is_none` for an optional argument traced as None; the front end's wrapper of
    fx-wrapped functions must not rename it ("attempt", unknown to the table)."""
    class Optional(nn.Module):
        def forward(self, x, mask=None):
            return x if mask is None else x * mask

    ops = ops_of(trace(Optional(), (torch.randn(2),)).graph_module)
    assert "assert_is_none" in ops and "attempt" not in ops
