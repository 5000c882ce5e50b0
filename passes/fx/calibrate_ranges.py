"""Range calibration: run the (still fp32) graph on sample inputs and record every value's range.

    convert(model, "O1", calibration_data=[(x1,), (x2,), ...])
    facts(node)["range"] = {"samples": 16, "max_abs": 7.1e4, "overflows": 3, "read_max": 2.0,
                            "read_from": "mul_1", "below_normal": 0.02}

Runs before decide_precision, on the traced graph nobody has rewritten yet, in eval mode and without
grad (batch norm statistics are not updated). Per sample, a node "overflows" when its own value or a
float value it reads is past the low dtype's largest finite number (a low node would read it as inf);
`below_normal` is the share of its non-zero values under the low dtype's smallest normal number (6.1e-5
for fp16), over all samples. painting/calibrate_keep_fp32.py turns these figures into decisions.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx
from tqdm.auto import tqdm

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.runner import PassResult

PROGRESS_FROM = 8     # samples; fewer run without a progress bar


def record_ranges(gm: fx.GraphModule, samples: Iterable, low_dtype: torch.dtype) -> PassResult:
    limits = torch.finfo(low_dtype)
    totals: dict[fx.Node, dict] = {}
    count = 0
    flags = {module: module.training for module in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad():
            for sample in _progress(samples):
                recorder = _RangeRecorder(gm, limits.tiny)
                recorder.run(*(sample if isinstance(sample, (tuple, list)) else (sample,)))
                _add_sample(totals, recorder.seen, limits.max)
                count += 1
    finally:
        for module, flag in flags.items():
            module.training = flag
    if count == 0:
        raise ValueError("calibration_data gave no samples: pass an iterable of input tuples, like example_inputs")
    for node, total in totals.items():
        below_normal = total.pop("tiny") / total["nonzero"] if total["nonzero"] else 0.0
        del total["nonzero"]
        facts(node)["range"] = {"samples": count, **total, "below_normal": below_normal}
    overflowing = sum(1 for total in totals.values() if total["overflows"])
    return PassResult(modified=False, counts={"samples": count, "nodes_overflowing": overflowing})


class _RangeRecorder(fx.Interpreter):
    """Keeps, per node, (largest finite |value|, non-zero values, non-zero values under `tiny`)."""

    def __init__(self, gm: fx.GraphModule, tiny: float):
        super().__init__(gm)
        self.tiny, self.seen = tiny, {}

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        tensors = [t for t in torch.utils._pytree.tree_leaves(result)
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if tensors and node.op != "output":
            finite = [m[m.isfinite()] for m in (t.detach().abs().float() for t in tensors)]
            self.seen[node] = (max((f.max().item() for f in finite if f.numel()), default=0.0),
                               sum(int((f > 0).sum()) for f in finite),
                               sum(int(((f > 0) & (f < self.tiny)).sum()) for f in finite))
        return result


def _add_sample(totals: dict, seen: dict, largest: float) -> None:
    for node, (max_abs, nonzero, tiny) in seen.items():
        total = totals.setdefault(node, {"max_abs": 0.0, "overflows": 0, "read_max": 0.0, "read_from": None,
                                         "tiny": 0, "nonzero": 0})
        total["max_abs"] = max(total["max_abs"], max_abs)
        total["nonzero"] += nonzero
        total["tiny"] += tiny
        read = max(node.all_input_nodes, key=lambda n: seen.get(n, (0.0,))[0], default=None)
        read_max = seen.get(read, (0.0,))[0] if read is not None else 0.0
        if read_max > total["read_max"]:
            total["read_max"], total["read_from"] = read_max, read.name
        if max_abs > largest or read_max > largest:      # a low node would read or write inf
            total["overflows"] += 1


def _progress(samples: Iterable):
    """A progress bar (on a terminal) when there are many samples or no telling how many."""
    try:
        many = len(samples) >= PROGRESS_FROM
    except TypeError:
        many = True
    return tqdm(samples, desc="calibrating ranges", unit="sample", disable=None if many else True, leave=False)
