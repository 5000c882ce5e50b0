"""The weight-cast cache of a dynamo graph: each parameter's low copy is made once and reused while it is unchanged.

Dynamo hands weights to the graph as inputs, so a plain converted graph casts every weight on every call (a decode
step casts the whole model). The cache is the frozen graphs' (amp_compiler/frozen.py: FrozenWeights): a copy is
used while the parameter is the same object with the same version counter, storage and sampled values; it is cast
afresh whenever autograd needs the weight (grad enabled and requires_grad: training, and each micro-batch of
gradient accumulation), and such a call drops that weight's copies (a step follows: they would be stale; the
copies of weights that need no gradient stay). In
inference (no_grad, inference_mode, or a parameter that needs no gradient, as a LoRA base model's) it is on by
default. Its blind spot is freeze's: a write through `.data` that changes few values (no version bump) is seen only
through the 16 sampled values. On a CPU with oneDNN in bf16 a linear's copy is kept packed in oneDNN's layout, the only copy of it:
the bytes of autocast's cached casts, and a one-row linear faster than fp32's.
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.frozen import FrozenWeights, freeze_graph, fuse_packed_linears


def cache_weight_casts(gm: fx.GraphModule, cache: FrozenWeights) -> dict:
    """Rewrite a converted dynamo graph's parameter casts to read `cache` (one per compiled model: the prefill and
    decode graphs share each weight's copy); returns the counts (also in gm.meta["amp"]["frozen"])."""
    parameters = {placeholder: info["name"] for placeholder, info in gm.meta["amp"]["graph_inputs"].items()
                  if info["kind"] == "parameter"}
    counts = freeze_graph(gm, weight_inputs=parameters, holder=cache)
    counts["linears_packed"] = fuse_packed_linears(gm)
    return counts
