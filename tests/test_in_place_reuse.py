"""Capture once per repeated block (in_place/reuse.py): a part identical to one captured before reuses its graph.

Every reused graph computes what a fresh capture computes (torch.equal), on its own block's parameters (an
in-place weight change moves that block only; gradients land on each block's own parameters), and blocks that
differ in a width, an attribute (Dropout's p), a hook or a requires_grad flag are captured apart.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.in_place import in_place_conversion, reuse

BF16 = torch.bfloat16
WIDTH = 16


class Block(nn.Module):
    def __init__(self, hidden=32, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, hidden)
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """Called with a state object (no graph can take it): the stack runs as written, each block is a part."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, state=None):
        for block in self.blocks:
            x = block(x)
        return x


class State:
    pass


def stack(count=4, seed=0, **block_options):
    torch.manual_seed(seed)
    return Stack([Block(**block_options) for _ in range(count)])


def converted(model, reuse_on=True, monkeypatch=None, **options):
    if not reuse_on:
        monkeypatch.setattr(reuse, "signature", lambda *args: None)
    amp_compiler.convert(model, "O1", dtype=BF16, inplace=True, capture="parts", **options)
    return model


def block_graphs(model):
    """blocks.i -> its one graph's GraphModule."""
    found = {}
    for path, part in in_place_conversion(model).parts.items():
        graphs = [graph for graphs in part.graphs.values() for graph in graphs]
        if graphs:
            assert len(graphs) == 1, path
            found[path] = graphs[0].gm
    return found


def reused_from(model):
    return {path: gm.meta["amp"].get("reused_from") for path, gm in block_graphs(model).items()}


def test_identical_blocks_capture_once_and_the_others_reuse():
    model = converted(stack().eval())
    with torch.no_grad():
        model(torch.randn(2, WIDTH), state=State())
    conversion = in_place_conversion(model)
    assert (conversion.captured, conversion.reused) == (1, 3)
    assert reused_from(model) == {"blocks.0": None, "blocks.1": "blocks.0", "blocks.2": "blocks.0",
                                  "blocks.3": "blocks.0"}
    parts = amp_compiler.explain(model).summary["parts"]   # the report counts a reuse as the part's capture
    assert [parts[f"blocks.{i}"]["captures"] for i in range(4)] == [1, 1, 1, 1]


def test_each_reused_graph_equals_a_fresh_capture(monkeypatch):
    reusing, fresh = stack().eval(), stack().eval()
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        out = converted(reusing)(x, state=State())
        with monkeypatch.context() as patch:
            expected = converted(fresh, False, patch)(x, state=State())
    assert in_place_conversion(fresh).reused == 0 and in_place_conversion(reusing).reused == 3
    assert torch.equal(out, expected)
    with torch.no_grad():
        for mine, theirs in zip(reusing.blocks, fresh.blocks):
            assert torch.equal(mine(x), theirs(x))
    fp32 = stack().eval()(x)
    assert not torch.equal(out, fp32) and torch.allclose(out, fp32, atol=0.1)   # it ran low, close to fp32


def test_a_reused_graph_reads_its_own_blocks_parameters():
    model = converted(stack().eval())
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        model(x, state=State())
        before = [block(x) for block in model.blocks]
        model.blocks[2].up.weight.add_(0.5)   # in place: the same Parameter, new values
        after = [block(x) for block in model.blocks]
    assert reused_from(model)["blocks.2"] == "blocks.0"
    assert [torch.equal(b, a) for b, a in zip(before, after)] == [True, True, False, True]
    reference = stack().eval()
    with torch.no_grad():
        reference.blocks[2].up.weight.add_(0.5)
        assert torch.allclose(after[2], reference.blocks[2](x), atol=0.1)


def test_gradients_land_on_each_blocks_own_parameters(monkeypatch):
    reusing, fresh, fp32 = stack(), stack(), stack()
    x = torch.randn(4, WIDTH)
    with torch.no_grad():   # the captures' call: one graph for all four blocks
        converted(reusing)(x, state=State())
        with monkeypatch.context() as patch:
            converted(fresh, False, patch)(x, state=State())
    for model in (reusing, fresh):   # every block's graph made: each must read its own block's weights
        model(x, state=State()).square().sum().backward()
    fp32(x).square().sum().backward()
    assert in_place_conversion(reusing).reused == 3   # the graphs made under no_grad serve the grad calls
    for (name, mine), theirs, reference in zip(reusing.named_parameters(), fresh.parameters(), fp32.parameters()):
        assert torch.equal(mine.grad, theirs.grad), name
        assert torch.allclose(mine.grad, reference.grad, rtol=0.05, atol=0.05), name
    grads = [block.up.weight.grad for block in reusing.blocks]
    assert not any(torch.equal(grads[0], other) for other in grads[1:])


class Settings:
    def __init__(self):
        self.negate = False


class ReadsSettings(Block):
    def __init__(self, settings):
        super().__init__()
        self.settings = settings

    def forward(self, x):
        y = super().forward(x)
        return -y if self.settings.negate else y


def test_a_shared_settings_object_changed_since_the_template_makes_another_capture():
    settings = Settings()
    torch.manual_seed(0)
    model = converted(Stack([ReadsSettings(settings) for _ in range(2)]).eval())
    x = torch.randn(2, WIDTH)
    in_place_conversion(model).parts[""].children_become_parts()   # as the stack running as written makes them
    with torch.no_grad():
        model.blocks[0](x)   # the template, captured with negate False
        settings.negate = True
        out = model.blocks[1](x)
        reference = ReadsSettings.forward(model.blocks[1], x)   # the class's forward: as written, fp32
    assert reused_from(model) == {"blocks.0": None, "blocks.1": None}
    assert (out * reference > 0).float().mean() > 0.95   # negated like the fp32 result, low precision aside


def _hooked_inside(block):
    block.up.register_forward_hook(lambda module, args, out: out * 2)
    return block


@pytest.mark.parametrize("odd_block", [
    lambda: Block(hidden=24),                              # another width: other parameter shapes
    lambda: Block(p=0.3),                                  # Dropout's p (eval: the same math, still apart)
    lambda: _hooked_inside(Block()),                       # a hook on a module inside
    lambda: Block().requires_grad_(False),                 # frozen parameters
], ids=["width", "dropout_p", "hook", "requires_grad"])
def test_a_block_that_differs_is_captured_apart(odd_block, monkeypatch):
    torch.manual_seed(0)
    blocks = [Block(), Block(), odd_block(), Block()]
    model = Stack(blocks).eval()
    fresh = copy.deepcopy(model)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        out = converted(model)(x, state=State())
        with monkeypatch.context() as patch:
            expected = converted(fresh, False, patch)(x, state=State())
    assert torch.equal(out, expected)
    assert reused_from(model) == {"blocks.0": None, "blocks.1": "blocks.0", "blocks.2": None,
                                  "blocks.3": "blocks.0"}


def test_frozen_reused_graphs_keep_their_own_weight_copies(monkeypatch):
    reusing, fresh = stack().eval(), stack().eval()
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        out = converted(reusing, freeze=True)(x, state=State())
        with monkeypatch.context() as patch:
            expected = converted(fresh, False, patch, freeze=True)(x, state=State())
        assert in_place_conversion(reusing).reused == 3
        assert torch.equal(out, expected)
        for mine, theirs in zip(reusing.blocks, fresh.blocks):
            assert torch.equal(mine(x), theirs(x))
        reusing.blocks[3].down.weight.mul_(2)   # block 3's frozen copies (only) are stale now
        changed = stack().eval()
        changed.blocks[3].down.weight.mul_(2)
        with monkeypatch.context() as patch:
            expected = converted(changed, False, patch, freeze=True)(x, state=State())
        assert torch.equal(reusing(x, state=State()), expected)


def test_a_deepcopy_of_the_model_keeps_no_templates():
    model = converted(stack().eval())
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        out = model(x, state=State())
        twin = copy.deepcopy(model)
        assert len(in_place_conversion(twin).templates) == 0
        assert torch.equal(twin(x, state=State()), out)


@pytest.mark.real_models
def test_llama_layers_reuse_their_projections_and_mlps(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    reusing = LlamaForCausalLM(config).eval()
    fresh, fp32 = copy.deepcopy(reusing), copy.deepcopy(reusing)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        tokens = converted(reusing).generate(ids, max_new_tokens=4, do_sample=False)
        with monkeypatch.context() as patch:
            expected = converted(fresh, False, patch).generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, expected)
        assert torch.equal(tokens, fp32.generate(ids, max_new_tokens=4, do_sample=False))
    conversion = in_place_conversion(reusing)
    reused = reused_from(reusing)
    assert reused["model.layers.3.mlp"] == "model.layers.0.mlp" and conversion.reused >= 4 * 5 - 5
    assert conversion.captured + conversion.reused == in_place_conversion(fresh).captured
    hidden = torch.randn(1, 6, 32)
    with torch.no_grad():
        for (path, mine), theirs in zip(reusing.named_modules(), fresh.modules()):
            if path in reused:
                assert torch.equal(mine(hidden), theirs(hidden)), path
