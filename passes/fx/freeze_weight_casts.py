"""Read the low-precision copy of a weight from a cache instead of casting it on every call (frozen inference).

    w_bf16 = amp_cast(self.fc.weight, torch.bfloat16)
        ->   copies = amp_frozen_check(self.amp_frozen_weights)          # once, first in the graph
             w_bf16 = amp_frozen_cast(self.fc.weight, torch.bfloat16, copies)
Only casts of a parameter or buffer read with get_attr change; activation casts stay. The cache
(amp_compiler/frozen.py: FrozenWeights, a child module named `holder`) decides at run time whether its
copy is still the weight's: the check compares a sample of every weight's values at once, each read the
weight's identity, version counter and storage; it casts afresh while training. Runs on a converted graph,
after the fx pipeline.

At the fp8 level a weight's scaling nodes go too: the cache keeps its fp8 copy
and scale (1 byte per weight, not bf16's 2), and the fp8 matmul reads the weight itself for its shape:

    w_bf16 = amp_frozen_cast(self.fc.weight, torch.bfloat16, copies)
    linear_w_amax = fp8_amax(w_bf16, None); linear_w_scale = fp8_scale(linear_w_amax, e4m3, 0)
    linear_w_fp8 = fp8_cast(w_bf16, linear_w_scale, e4m3)
    linear = fp8_scaled_linear(x, w_bf16, x_fp8, linear_w_fp8, x_scale, linear_w_scale, ...)
        ->   w_frozen = amp_frozen_fp8_weight(self.fc.weight, torch.bfloat16, e4m3, None, 0, copies)
             linear = fp8_scaled_linear(x, w_frozen[0], x_fp8, w_frozen[1], x_scale, w_frozen[2], ...)
Delayed scaling (fp8_delayed_scale) likewise: the node then also reads the Fp8History, and the copy is made again
when that history changes (it records only in training mode, when the weight is quantized every call anyway).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from amp_compiler.passes.fx.fp8_runtime import fp8_amax, fp8_cast, fp8_delayed_scale, fp8_scale
from amp_compiler.passes.fx.runtime import (amp_frozen_cast, amp_frozen_check, amp_frozen_module_call,
                                             amp_module_call, graph_leaf, is_cast, is_float)
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.runner import PassResult


def freeze_weight_casts(gm: fx.GraphModule, holder: str, weight_inputs: dict | None = None) -> PassResult:
    """`weight_inputs`: {placeholder name: the user's parameter name} for a graph that takes its weights as inputs
    (TorchDynamo's): their casts are frozen like those of get_attr weights."""
    graph, frozen, module_calls = gm.graph, 0, 0
    weight_inputs = weight_inputs or {}
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
        if source.op not in ("get_attr", "placeholder") or cast.kwargs or len(cast.args) != 2:
            continue
        if source.op == "get_attr":
            weight, name = operator.attrgetter(source.target)(gm), source.target
        else:
            weight, name = source.meta.get("val"), weight_inputs.get(source.name)
        if name is None or not isinstance(weight, torch.Tensor) or not is_float(weight.dtype):
            continue
        cast.target = amp_frozen_cast
        cast.args = (source, dtype, copies())
        cast.meta["amp"] = {**cast.meta.get("amp", {}), "rule": f"frozen: {name} cast once, cached"}
        frozen += 1
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target is amp_module_call]:
        module, dtype, *args = call.args   # a low leaf (an RNN): its parameters are read from the cache too
        call.target = amp_frozen_module_call
        call.args = (module, dtype, copies(), *args)
        module_calls += 1
    fp8_weights = sum(_freeze_fp8_weight(graph, cast) for cast in [n for n in graph.nodes if n.target is fp8_cast])
    return PassResult(modified=frozen + module_calls + fp8_weights > 0,
                      counts={"weight_casts_frozen": frozen, "module_calls_frozen": module_calls,
                              "fp8_weights_frozen": fp8_weights})


@graph_leaf
def amp_frozen_fp8_weight(weight, dtype: torch.dtype, fp8_dtype: torch.dtype, dim, margin: int, copies,
                          histories=None, which: str = "w", amax_from: str = "max"):
    """(weight for the fp8 matmul node, fp8 copy, scale) from `copies` (amp_compiler/frozen.py:
    FrozenWeights.read_fp8): quantized once, again only when the weight (or, delayed, its history) changed;
    quantized per call while training. `histories`: delayed scaling's Fp8History, None for current scaling."""
    delayed = (histories, which, amax_from) if histories is not None else None
    return copies.read_fp8(weight, dtype, fp8_dtype, dim, margin, delayed)


def _scaling(scale: fx.Node) -> tuple | None:
    """(amax node, margin, (histories, which, amax_from) or None) of a weight's fp8_scale/fp8_delayed_scale node
    as lower_fp8_matmuls writes it (all arguments positional); None for anything else."""
    if not isinstance(scale, fx.Node) or scale.kwargs:
        return None
    if scale.target is fp8_scale and len(scale.args) == 3:
        return scale.args[0], scale.args[2], None
    if scale.target is fp8_delayed_scale and len(scale.args) == 6:
        amax, histories, which, _, margin, amax_from = scale.args
        return amax, margin, (histories, which, amax_from)
    return None


def _freeze_fp8_weight(graph: fx.Graph, cast: fx.Node) -> bool:
    """Replace one frozen weight's scaling nodes (amax -> scale -> cast, module docstring) by one read of its
    cached fp8 copy; False (unchanged) for anything else (an activation's)."""
    low, scale, fp8_dtype = cast.args
    scaling = _scaling(scale)
    amax = scaling[0] if scaling is not None else None
    if (cast.kwargs or not isinstance(low, fx.Node) or low.target is not amp_frozen_cast or amax is None
            or amax.target is not fp8_amax or amax.kwargs or len(amax.args) != 2 or amax.args[0] is not low):
        return False
    weight, dtype, copies = low.args
    dim, (_, margin, delayed) = amax.args[1], scaling
    matmuls = list(cast.users)
    with graph.inserting_before(cast):
        frozen = graph.call_function(amp_frozen_fp8_weight, (weight, dtype, fp8_dtype, dim, margin, copies,
                                                             *(delayed or ())))
        items = [graph.call_function(operator.getitem, (frozen, i)) for i in range(3)]
    rule = f"frozen: {weight.target} as {dtype_name(fp8_dtype)} with its scale, quantized once, cached"
    module = cast.meta.get("amp", {}).get("module", "")
    for node, value_dtype in zip((frozen, *items), (None, None, fp8_dtype, torch.float32)):
        node.meta["amp"] = {"op": "amp_frozen_fp8_weight", "module": module, "precision": None, "dtype": value_dtype,
                            "rule": rule}
    for matmul in matmuls:   # the matmul reads the weight itself; the bf16 copy stays only for other readers
        matmul.replace_input_with(low, items[0])
    cast.replace_all_uses_with(items[1])
    scale.replace_all_uses_with(items[2])
    for node in (cast, scale, amax, low):
        if not node.users:
            graph.erase_node(node)
    return True
