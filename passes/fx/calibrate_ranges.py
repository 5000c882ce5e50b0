"""Range calibration on fx: run the (still fp32) graph on sample inputs and record every node's range.

    convert(model, "O1", calibration_data=[(x1,), (x2,), ...])
    facts(node)["range"] = {"samples": 16, "max_abs": 7.1e4, "overflows": 3, "read_max": 2.0,
                            "read_from": "mul_1", "below_normal": 0.02}

Runs before decide_precision, on the traced graph nobody has rewritten yet, in eval mode and without
grad (batch norm statistics are not updated). Per sample, a node "overflows" when its own value or a
float value it reads is past the low dtype's largest finite number (a low node would read it as inf);
`below_normal` is the share of its non-zero values under the low dtype's smallest normal number (6.1e-5
for fp16), over all samples. painting/calibrate_ranges.py keeps the figures and turns them into decisions.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx

from amp_compiler.passes.fx.decide_precision import module_path
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.painting.calibrate_ranges import (RangeTotals, calibration_sample, check_calibration_data,
                                                           progress, value_stats)
from amp_compiler.passes.policy.numerics import DROPOUTS, dtype_name
from amp_compiler.passes.runner import PassResult


def record_ranges(gm: fx.GraphModule, samples: Iterable, low_dtype: torch.dtype) -> PassResult:
    check_calibration_data(samples)
    totals = RangeTotals(low_dtype)
    arity = sum(node.op == "placeholder" for node in gm.graph.nodes)
    flags = {module: module.training for module in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad():
            for index, sample in enumerate(progress(samples)):
                recorder = _RangeRecorder(gm, totals.limits.tiny, index)
                recorder.run(*calibration_sample(index, sample, arity))
                totals.add_sample(recorder.seen, lambda node: node.all_input_nodes)
    finally:
        for module, flag in flags.items():
            module.training = flag
    return PassResult(modified=False, counts=totals.record())


class EvalModeInterpreter(fx.Interpreter):
    """Runs a graph as eval mode would: `F.dropout(x, training=self.training)` had the flag baked in at capture
    (True for a model traced in training mode), which gm.eval() cannot undo; such a node returns its input, as
    eval-mode dropout does, and draws nothing from the RNG. (nn.Dropout modules follow gm.eval() themselves.)"""

    def run_node(self, node: fx.Node):
        if node.op == "call_function" and facts(node).get("op") in DROPOUTS:
            return self.env[node.args[0]] if node.args else self.env[node.kwargs["input"]]
        return super().run_node(node)


class _RangeRecorder(EvalModeInterpreter):
    """Keeps value_stats() of every node's float outputs."""

    def __init__(self, gm: fx.GraphModule, tiny: float, index: int):
        super().__init__(gm)
        self.tiny, self.seen, self.index = tiny, {}, index
        self.extra_traceback = False   # a failure names the sample and the node itself

    def run_node(self, node: fx.Node):
        try:
            result = super().run_node(node)
        except Exception as error:  # noqa: BLE001 - the user's sample, not the graph, is what to fix
            inputs = ", ".join(_describe(self.env.get(n)) for n in self.graph.nodes if n.op == "placeholder")
            first = (str(error).strip().splitlines() or [""])[0][:200]
            module = module_path(node)
            where = f"node {node.name}" + (f" (module {module!r})" if module else "")
            raise ValueError(f"calibration_data sample {self.index} ({inputs}) fails at {where}: "
                             f"{type(error).__name__}: {first}") from error
        tensors = [t for t in torch.utils._pytree.tree_leaves(result)
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if tensors and node.op != "output":
            self.seen[node] = value_stats(tensors, self.tiny)
        return result


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)}{list(value.shape)}"
    return type(value).__name__
