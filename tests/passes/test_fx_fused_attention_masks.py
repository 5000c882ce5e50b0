"""fx/fused_attention_masks.py: an sdpa mask whose fake value has a strided last dim (an expanded mask) goes
through mask_for_fused_attention, once per mask however many calls read it; a dense mask, or one with no fake
value, is left alone. On CPU the helper returns the mask itself: outputs are unchanged."""
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.fused_attention_masks import fused_attention_masks
from amp_compiler.passes.fx.propagate_values import propagate_values
from amp_compiler.passes.fx.runtime import mask_for_fused_attention, strided_last_dim
from amp_compiler.passes.node_facts import facts


class Expanded(nn.Module):
    """BERT's captured mask: (arange(seq) >= 0)[None, None, :, None] expanded to batch x 1 x seq x seq."""

    def forward(self, q, dense):
        mask = (torch.arange(q.shape[2]) >= 0)[None, None, :, None].expand(q.shape[0], 1, q.shape[2], q.shape[2])
        a = F.scaled_dot_product_attention(q, q, q, mask)
        b = F.scaled_dot_product_attention(a, a, a, attn_mask=mask)
        return F.scaled_dot_product_attention(b, b, b, dense), F.scaled_dot_product_attention(b, b, b)


def prepared(values=True):
    q, dense = torch.randn(2, 1, 4, 8), torch.rand(2, 1, 4, 4) > 0.3
    dense[..., 0] = True   # no fully masked row
    gm = fx.symbolic_trace(Expanded())
    canonicalize(gm)
    if values:
        propagate_values(gm, (q, dense))
    return gm, (q, dense)


def sdpa_masks(gm):
    calls = [n for n in gm.graph.nodes if facts(n).get("op") == "scaled_dot_product_attention"]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in calls]


def test_an_expanded_mask_is_wrapped_once_for_every_call_that_reads_it():
    gm, inputs = prepared()
    expected = gm(*inputs)
    expand = next(n for n in gm.graph.nodes if facts(n).get("op") == "expand")
    assert strided_last_dim(expand.meta["val"])
    result = fused_attention_masks(gm)
    assert result.modified and result.counts == {"attention_masks_made_dense_on_gpu": 1}
    first, second, third, fourth = sdpa_masks(gm)
    assert first is second and first.target is mask_for_fused_attention and first.args == (expand,)
    assert facts(first)["class"] == "ignore" and facts(first)["rule"].startswith("layout: an expanded attention mask")
    assert third.name == "dense" and fourth is None   # a dense input mask, no mask: as they were
    gm.graph.lint()
    gm.recompile()
    for got, want in zip(gm(*inputs), expected):
        assert torch.equal(got, want)


def test_on_cpu_the_helper_returns_the_mask_itself():
    mask = torch.ones(4, 1).bool().expand(4, 4)
    assert mask_for_fused_attention(mask) is mask


def test_without_fake_values_nothing_is_wrapped():
    gm, _ = prepared(values=False)
    code = gm.code
    result = fused_attention_masks(gm)
    assert not result.modified and result.counts == {"attention_masks_made_dense_on_gpu": 0}
    gm.recompile()
    assert gm.code == code
