"""Record node.meta["val"], a fake value per node, by running the graph on fake example inputs.

    propagate_values(gm, (x,))   ->   every node it could run carries meta["val"] (shape and dtype, no data)

torch.export graphs already carry these; this gives fx graphs the same facts when example inputs are
known, so infer_dtypes reads dtypes rather than deriving them. A node that cannot run on fake tensors
(data-dependent output shapes, an opaque body that needs real data) gets no value, nor do the nodes
that read it: infer_dtypes falls back to its rules there.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from amp_compiler.passes.runner import PassResult


class _Unknown:
    """Stands for a value that could not be computed."""


class _FakePropagator(fx.Interpreter):
    def run_node(self, node: fx.Node):
        unknown = []
        fx.node.map_arg((node.args, node.kwargs),
                        lambda n: unknown.append(n) if isinstance(self.env.get(n), _Unknown) else None)
        if unknown:
            return _Unknown()
        try:
            value = super().run_node(node)
        except Exception:  # noqa: BLE001 - one node that needs real data must not stop the rest
            return _Unknown()
        if node.op != "output":
            node.meta["val"] = value
        return value


def propagate_values(gm: fx.GraphModule, example_inputs: tuple) -> PassResult:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = torch.utils._pytree.tree_map(
        lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fake_inputs):
        return PassResult(modified=False, counts={"values_propagated": 0})
    with mode, torch.no_grad():
        _FakePropagator(gm).run(*fake_inputs)
    known = sum("val" in n.meta for n in gm.graph.nodes)
    return PassResult(modified=False, counts={"values_propagated": known})
