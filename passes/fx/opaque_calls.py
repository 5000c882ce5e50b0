"""Opaque calls: code torch.fx cannot see into runs as written, as one node, with its inputs uncast.

    y = amp_opaque_call(self.block, (None, None), x)                      as traced: runs as written
    y = amp_opaque_call(self.block, (torch.bfloat16, torch.float32), x)   after plan_opaque_calls

The front end makes one for a submodule whose forward fx cannot trace, a function wrapped with
torch.fx.wrap that cannot be traced into, and every custom torch.autograd.Function (so its own backward
runs). Inputs are never cast: an opaque body may write into them in place, and a cast copy would take
the write. `plan_opaque_calls` decides how the body runs: under torch.autocast with the level's low
dtype (the body's matmuls low, its softmax and norms fp32, as autocast picks), and with its float
outputs returned in the dtype the original model produced, so the passes know every value's dtype.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from amp_compiler.passes.fx.runtime import amp_opaque_call, is_float
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name

AS_WRITTEN = (None, None)   # (autocast dtype, output dtype): no autocast, outputs as the body returns them


def is_opaque_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is amp_opaque_call


def plan_opaque_calls(gm: fx.GraphModule, low: torch.dtype | None) -> PassResult:
    """Run every opaque body under autocast(low) (None: as written) and return the original dtype."""
    planned = 0
    for node in gm.graph.nodes:
        if not is_opaque_call(node):
            continue
        original = facts(node).get("dtype")
        policy = (low, original if low is not None and is_float(original) else None)
        node.args = (node.args[0], policy, *node.args[2:])
        how = f"under torch.autocast({dtype_name(low)})" if low is not None else "as written"
        facts(node)["rule"] = f"opaque ({node.meta.get('amp_opaque', 'not traceable')}): runs {how}, " \
                                   "inputs uncast"
        planned += 1
    return PassResult(modified=planned > 0, counts={"opaque_calls": planned})
