"""Range calibration, the IR-neutral part: the figures of each node over the samples, and the decision
that keeps fp32 the painted-low nodes whose values the low dtype cannot hold (a `painted` hook of the
decide step, decide.py, so it works on any IR's view).

    totals = RangeTotals(torch.float16); totals.add_sample(seen, inputs_of); totals.record()
    view node "mul_1": precision low -> fp32, rule "range: max |x| = 1e5 > 65504 on 16 of 16 samples"

Each IR runs the fp32 model on the samples its own way (fx: passes/fx/calibrate_ranges.py, ONNX:
passes/onnx/calibrate_ranges.py) and hands over, per sample, value_stats() of every node's outputs.
`ranges` maps a node name to the figures recorded: samples, max_abs (its own values), overflows (samples
where the node's value, or a value it reads, was past the low dtype's largest number), read_max and
read_from (the largest input), below_normal (share of its non-zero values under the low dtype's smallest
normal number). A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable, Iterable

import networkx as nx
import torch
from tqdm.auto import tqdm

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name, low_finfo

MOSTLY = 0.5          # a node whose values are more than half below the normal range is kept fp32
PROGRESS_FROM = 8     # samples; fewer run without a progress bar


def value_stats(tensors: list[torch.Tensor], tiny: float) -> tuple[float, int, int]:
    """(largest finite |x|, non-zero values, non-zero values under `tiny`) over a node's float outputs."""
    finite = [m[m.isfinite()] for m in (t.detach().abs().float() for t in tensors)]
    return (max((f.max().item() for f in finite if f.numel()), default=0.0), sum(int((f > 0).sum()) for f in finite),
            sum(int(((f > 0) & (f < tiny)).sum()) for f in finite))


class RangeTotals:
    """The figures of every node over the samples seen so far."""

    def __init__(self, low_dtype: torch.dtype):
        self.limits, self.samples, self.totals = low_finfo(low_dtype), 0, {}

    def add_sample(self, seen: dict, inputs_of: Callable) -> None:
        """seen: node -> value_stats(...) of one sample; inputs_of(node): the nodes whose values it reads."""
        self.samples += 1
        for node, (max_abs, nonzero, tiny) in seen.items():
            total = self.totals.setdefault(node, {"max_abs": 0.0, "overflows": 0, "read_max": 0.0, "read_from": None,
                                                  "tiny": 0, "nonzero": 0})
            total["max_abs"] = max(total["max_abs"], max_abs)
            total["nonzero"] += nonzero
            total["tiny"] += tiny
            read = max(inputs_of(node), key=lambda n: seen.get(n, (0.0,))[0], default=None)
            read_max = seen.get(read, (0.0,))[0] if read is not None else 0.0
            if read_max > total["read_max"]:
                total["read_max"], total["read_from"] = read_max, read
            if max_abs > self.limits.max or read_max > self.limits.max:   # a low node would read or write inf
                total["overflows"] += 1

    def record(self) -> dict[str, int]:
        """facts(node)["range"] for every node seen (fx and onnx_ir nodes alike); returns the pass's counts."""
        if self.samples == 0:
            raise ValueError("calibration_data gave no samples: pass an iterable of input tuples, like example_inputs")
        for node, total in self.totals.items():
            below_normal = total["tiny"] / total["nonzero"] if total["nonzero"] else 0.0
            read_from = total["read_from"].name if total["read_from"] is not None else None
            facts(node)["range"] = {"samples": self.samples, "max_abs": total["max_abs"], "overflows": total["overflows"],
                                    "read_max": total["read_max"], "read_from": read_from, "below_normal": below_normal}
        overflowing = sum(1 for total in self.totals.values() if total["overflows"])
        return {"samples": self.samples, "nodes_overflowing": overflowing}


def check_calibration_data(samples) -> None:
    """calibration_data is an iterable of samples: a bare tensor would be split into rows, a string into letters."""
    if samples is None:
        return
    shape = getattr(samples, "shape", None)
    if shape is not None or isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Iterable):
        got = f"a {type(samples).__name__}" + (f" of shape {list(shape)}" if shape is not None else "")
        raise TypeError(f"calibration_data must be an iterable of input tuples, e.g. [(x1,), (x2,)]; got {got}")


def calibration_sample(index: int, sample, arity: int) -> tuple:
    """One sample as the tuple of the model's inputs; a bare tensor is a one-input sample."""
    inputs = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    if len(inputs) != arity:
        raise ValueError(f"calibration_data sample {index} has {len(inputs)} input(s); the model takes {arity}")
    return inputs


def progress(samples: Iterable):
    """A progress bar (on a terminal) when there are many samples or no telling how many."""
    try:
        many = len(samples) >= PROGRESS_FROM
    except TypeError:
        many = True
    return tqdm(samples, desc="calibrating ranges", unit="sample", disable=None if many else True, leave=False)


def range_rule(figures: dict, low_dtype: torch.dtype) -> str | None:
    """Why the figures keep a node fp32 (the rule text), or None when the low dtype holds them."""
    limits = low_finfo(low_dtype)
    if figures["overflows"]:
        own = figures["max_abs"] > limits.max
        reads = "" if own else f"reads {figures['read_from']}: "
        return (f"range: {reads}max |x| = {_short(figures['max_abs' if own else 'read_max'])} > {limits.max:g} on "
                f"{figures['overflows']} of {figures['samples']} samples")
    if figures["below_normal"] > MOSTLY:
        return (f"range: {figures['below_normal']:.0%} of its non-zero values are below "
                f"{dtype_name(low_dtype)}'s normal range ({_short(limits.tiny)}) over "
                f"{figures['samples']} samples")
    return None


def _short(value: float) -> str:
    """7.1e4 rather than 7.1e+04."""
    return f"{value:.2g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


def calibrated_hooks(nodes: Iterable, low_dtype: torch.dtype) -> tuple:
    """The painted hooks for decide(): keep_out_of_range_fp32 when calibration recorded ranges, else none."""
    ranges = {node.name: facts(node)["range"] for node in nodes if "range" in facts(node)}
    return (keep_out_of_range_fp32(ranges, low_dtype),) if ranges else ()


def keep_out_of_range_fp32(ranges: dict[str, dict], low_dtype: torch.dtype) -> Callable[[nx.DiGraph], None]:
    def hook(view: nx.DiGraph) -> None:
        for name, attrs in view.nodes(data=True):
            figures = ranges.get(name)
            forced = attrs.get("forced")
            if figures is None or attrs.get("precision") != "low" or (forced and forced[0] == "low"):
                continue
            rule = range_rule(figures, low_dtype)
            if rule is not None:
                attrs["precision"], attrs["rule"] = "fp32", rule
    return hook
