"""Keep fp32 the path of a constant the low dtype cannot hold, from the node that reads it to its first
reader that does not carry its magnitude on (a `painted` hook of the decide step, decide.py, any IR).

    scores.masked_fill(mask, torch.finfo(torch.float32).min) -> softmax        (O2 bf16, everything low)
    view node "masked_fill": low -> fp32, rule "clear: reads the constant -3.40282e+38, beyond bf16's ..."
    view node "softmax":     low -> fp32, rule "deny: reads masked_fill's constant -3.40282e+38, ..."

In a low dtype the constant is not held: bf16's masked_fill raises ("cannot be converted to type
c10::BFloat16 without overflow"), a cast makes it -inf, and a softmax row that is all -inf gives NaN where
fp32 gives a uniform row. So the node that reads it runs fp32, and so do the nodes its value reaches through
infer/clear nodes (pointwise ops and data movement keep its magnitude: a mask added to the scores), up to
and including the first reader of another class (softmax, a matmul), whose output no longer holds it.
A node the user forced low stays low (the fx pipeline's FP16RangeWarning then says where fp16 makes inf).
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from amp_compiler.passes.painting.paint_precision import keep_fp32
from amp_compiler.passes.policy.numerics import low_max, short_name


def beyond_rule(op_class: str, constant: str, low_dtype: str) -> str:
    """'clear: reads the constant -3.40282e+38, beyond bf16's 3.3895e+38: kept fp32'."""
    return f"{op_class}: reads {constant}, beyond {short_name(low_dtype)}'s {low_max(low_dtype):.5g}: kept fp32"


def keep_constant_paths_fp32(sources: dict[str, tuple[str, list[str]]], carriers: set[str],
                             low_dtype: str) -> Callable[[nx.DiGraph], None]:
    """sources: node name -> (the constant beyond the low dtype's range it holds or reads: "the constant
    -1e+09", "the tensor constant bias, which holds -1e+09"; the names of its readers). A source outside the
    view (a tensor constant, a torch.full) starts at its readers. carriers: the nodes whose op the policy
    table calls infer or clear (the view's classes cannot tell: O2 paints them all as allow). The hook keeps
    the paths fp32."""
    def hook(view: nx.DiGraph) -> None:
        for source, (constant, readers) in sources.items():
            starts = [source] if source in view else [r for r in readers if r in view]
            # keep_fp32 is False on a node the user forced low: its output no longer holds the constant, so
            # the walk stops there, as keep_phases_fp32's does
            walked = [s for s in starts
                      if keep_fp32(view, s, beyond_rule(view.nodes[s]["op_class"], constant, low_dtype))]
            seen, stack = set(starts), [s for s in walked if s in carriers]
            while stack:
                for reader in view.successors(stack.pop()):
                    if reader in seen:
                        continue
                    seen.add(reader)
                    attrs = view.nodes[reader]
                    kept = keep_fp32(view, reader, beyond_rule(attrs["op_class"], f"{source}'s value ({constant})",
                                                               low_dtype))
                    if kept and reader in carriers:
                        stack.append(reader)
    return hook
