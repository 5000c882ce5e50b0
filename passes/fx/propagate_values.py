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


class _Propagate(torch.nn.Module):
    """Runs the propagator as a module call, so functional_call can swap in fake parameters and buffers."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, *inputs):
        return _FakePropagator(self.gm).run(*inputs)


def propagate_values(gm: fx.GraphModule, example_inputs: tuple) -> PassResult:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    fake_inputs = torch.utils._pytree.tree_map(fake, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fake_inputs):
        return PassResult(modified=False, counts={"values_propagated": 0})
    runner = _Propagate(gm)
    # Fake parameters and buffers too: a train-mode BatchNorm's `num_batches_tracked.add_(1)` would
    # otherwise count a step on the user's real buffer each time a model is converted.
    state = {name: fake(t) for name, t in (*runner.named_parameters(remove_duplicate=False),
                                           *runner.named_buffers(remove_duplicate=False))}
    with mode, torch.no_grad():
        torch.func.functional_call(runner, state, fake_inputs, tie_weights=False)
    known = sum("val" in n.meta for n in gm.graph.nodes)
    return PassResult(modified=False, counts={"values_propagated": known})
