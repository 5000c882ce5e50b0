"""Read the low-precision copy of a weight from a cache instead of casting it on every call (frozen inference).

    w_bf16 = amp_cast(self.fc.weight, torch.bfloat16)
        ->   copies = amp_frozen_check(self.amp_frozen_weights)          # once, first in the graph
             w_bf16 = amp_frozen_cast(self.fc.weight, torch.bfloat16, copies)
Only casts of a parameter or buffer read with get_attr change; activation casts stay. The cache
(amp_compiler/frozen.py: FrozenWeights, a child module named `holder`) decides at run time whether its
copy is still the weight's: the check compares a sample of every weight's values at once, each read the
weight's identity, version counter and storage; it casts afresh while training. Runs on a converted graph,
after the fx pipeline.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from amp_compiler.passes.fx.runtime import (amp_frozen_cast, amp_frozen_check, amp_frozen_module_call,
                                             amp_module_call, is_cast, is_float)
from amp_compiler.passes.runner import PassResult


def freeze_weight_casts(gm: fx.GraphModule, holder: str) -> PassResult:
    graph, frozen, module_calls = gm.graph, 0, 0
    holder_node = None

    def copies() -> fx.Node:
        nonlocal holder_node
        if holder_node is None:
            first_compute = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first_compute):
                holder_node = graph.call_function(amp_frozen_check, (graph.get_attr(holder),))
            holder_node.meta["amp"] = {"op": "amp_frozen_check", "class": "io", "precision": None,
                                       "rule": "frozen inference: the cache of low-precision weight copies, "
                                               "checked once per call"}
        return holder_node

    for cast in [n for n in graph.nodes if is_cast(n)]:
        source, dtype = cast.args[:2]
        if source.op != "get_attr" or cast.kwargs or len(cast.args) != 2:
            continue
        weight = operator.attrgetter(source.target)(gm)
        if not isinstance(weight, torch.Tensor) or not is_float(weight.dtype):
            continue
        cast.target = amp_frozen_cast
        cast.args = (source, dtype, copies())
        cast.meta["amp"] = {**cast.meta.get("amp", {}), "rule": f"frozen: {source.target} cast once, cached"}
        frozen += 1
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target is amp_module_call]:
        module, dtype, *args = call.args   # a low leaf (an RNN): its parameters are read from the cache too
        call.target = amp_frozen_module_call
        call.args = (module, dtype, copies(), *args)
        module_calls += 1
    return PassResult(modified=frozen + module_calls > 0,
                      counts={"weight_casts_frozen": frozen, "module_calls_frozen": module_calls})
