"""Range calibration's decision: keep fp32 the painted-low nodes whose calibrated values the low dtype
cannot hold. A `painted` hook of the decide step (decide.py), so it works on any IR's view.

    view node "mul_1": precision low -> fp32, rule "range: max |x| = 1e+05 > 65504 on 16 of 16 samples"

`ranges` maps a node name to the figures a front end recorded (fx: passes/fx/calibrate_ranges.py):
samples, max_abs (its own values), overflows (samples where the node's value, or a value it reads, was
past the low dtype's largest number), read_max and read_from (the largest input), below_normal (share of its non-zero values
under the low dtype's smallest normal number). A node the user forced low stays low.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx
import torch

MOSTLY = 0.5   # a node whose values are more than half below the normal range is kept fp32


def range_rule(figures: dict, low_dtype: torch.dtype) -> str | None:
    """Why the figures keep a node fp32 (the rule text), or None when the low dtype holds them."""
    limits = torch.finfo(low_dtype)
    if figures["overflows"]:
        own = figures["max_abs"] > limits.max
        reads = "" if own else f"reads {figures['read_from']}: "
        return (f"range: {reads}max |x| = {_short(figures['max_abs' if own else 'read_max'])} > {limits.max:g} on "
                f"{figures['overflows']} of {figures['samples']} samples")
    if figures["below_normal"] > MOSTLY:
        return (f"range: {figures['below_normal']:.0%} of its non-zero values are below "
                f"{str(low_dtype).removeprefix('torch.')}'s normal range ({_short(limits.tiny)}) over "
                f"{figures['samples']} samples")
    return None


def _short(value: float) -> str:
    """7.1e4 rather than 7.1e+04."""
    return f"{value:.2g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


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
