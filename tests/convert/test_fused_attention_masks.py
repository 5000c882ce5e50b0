"""fused_attention_masks: an sdpa mask the captured graph expands along its last dim (stride 0) reaches the
kernel dense on a GPU, where torch's fused attention kernels require stride 1 there (else the math kernel
runs, in fp32); on the CPU, whose kernels take any stride, it is passed as it is."""
import pytest
import torch

import amp_compiler
from amp_compiler.passes.fx.runtime import mask_for_fused_attention
from real_models import REAL_MODELS


@pytest.mark.slow
def test_hf_bert_reads_its_expanded_mask_through_the_helper_with_unchanged_outputs():
    """Called with token ids alone, BERT builds (arange(seq) >= 0) expanded to (batch, 1, seq, seq)."""
    spec = REAL_MODELS["hf_bert_sdpa"]
    model, (token_ids, padding) = spec.build(), spec.inputs()
    inputs = (token_ids,)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    attention = [n for n in gm.graph.nodes if n.meta.get("amp", {}).get("op") == "scaled_dot_product_attention"]
    assert attention
    for node in attention:
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        assert mask is not None and mask.target is mask_for_fused_attention
        assert mask.args[0].meta["val"].stride(-1) == 0          # what the helper is there for
    assert gm.meta["amp"]["pass_counts"]["fused_attention_masks"]["attention_masks_made_dense_on_gpu"] == 1
    plain = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=inputs)
    plain.graph.eliminate_dead_code()
    for node in [n for n in plain.graph.nodes if n.target is mask_for_fused_attention]:
        node.replace_all_uses_with(node.args[0])
        plain.graph.erase_node(node)
    plain.recompile()
    with torch.no_grad():
        torch.testing.assert_close(spec.output(gm(*inputs)), spec.output(plain(*inputs)), rtol=0, atol=0)
    # With a padding mask as input the mask is built dense: nothing to do.
    padded = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(token_ids, padding))
    assert padded.meta["amp"]["pass_counts"]["fused_attention_masks"]["attention_masks_made_dense_on_gpu"] == 0


def test_the_helper_makes_a_dense_copy_off_the_cpu_only_and_only_when_the_last_dim_is_strided():
    expanded = torch.ones(1, 1, 8, 1, dtype=torch.bool, device="meta").expand(4, 1, 8, 8)
    assert mask_for_fused_attention(expanded).stride(-1) == 1
    dense = torch.ones(4, 1, 8, 8, dtype=torch.bool, device="meta")
    assert mask_for_fused_attention(dense) is dense
    on_cpu = torch.ones(1, 1, 8, 1, dtype=torch.bool).expand(4, 1, 8, 8)
    assert mask_for_fused_attention(on_cpu) is on_cpu            # the CPU kernels take any stride: no copy
    assert mask_for_fused_attention(None) is None
