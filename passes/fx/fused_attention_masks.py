"""Give an attention mask the layout GPU fused-attention kernels accept, when the graph made it expanded.

    sdpa(q, k, v, mask)   ->   sdpa(q, k, v, mask_for_fused_attention(mask))
torch.export captures the mask a transformer builds for itself (Hugging Face skips it in eager when nothing
is masked, but keeps it under tracing): BERT's is `(arange(seq) >= 0)[None, None, :, None]` expanded to
(batch, 1, seq, seq), whose last dim has stride 0. torch's GPU backends require stride 1 there, so every
attention call fell back to the math kernel, which computes fp16 attention in fp32. The helper makes the
mask dense on a GPU only (one copy, shared by every layer that reads the same mask); the CPU kernels accept
any stride. Only masks whose fake value shows a last-dim stride other than 1 are wrapped.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from amp_compiler.passes.fx.runtime import mask_for_fused_attention, strided_last_dim
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.runner import PassResult

MASK_POSITION = 3   # scaled_dot_product_attention(query, key, value, attn_mask, ...)


def _mask_of(node: fx.Node):
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"]
    return node.args[MASK_POSITION] if len(node.args) > MASK_POSITION else None


def fused_attention_masks(gm: fx.GraphModule) -> PassResult:
    graph, wrapped = gm.graph, {}
    for node in list(graph.nodes):
        if facts(node).get("op") != "scaled_dot_product_attention" or node.op != "call_function":
            continue
        mask = _mask_of(node)
        fake = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if not isinstance(fake, torch.Tensor) or not strided_last_dim(fake):
            continue
        if mask not in wrapped:
            with graph.inserting_after(mask):
                dense = graph.call_function(mask_for_fused_attention, (mask,))
            dense.meta["val"] = fake
            dense.meta["amp"] = {"op": "mask_for_fused_attention", "class": "ignore", "precision": None,
                                 "rule": "layout: an expanded attention mask made dense on a GPU, where fused "
                                         "attention kernels need its last dim at stride 1"}
            wrapped[mask] = dense
        node.replace_input_with(mask, wrapped[mask])
    return PassResult(modified=bool(wrapped), counts={"attention_masks_made_dense_on_gpu": len(wrapped)})
