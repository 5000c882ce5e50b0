"""convert()'s own cost (issue 22): identical repeated blocks are exported once (frontend/repeated_blocks.py), and
a model built on the meta device converts, then takes real weights (to_empty + load_state_dict).

A spliced graph is the graph a full export gives: same code (node names included), same decisions, same outputs;
blocks whose graph depends on their index are exported whole. Speed is measured in benchmarks/bench_convert_scale.py.
"""
from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.frontend import repeated_blocks

transformers = pytest.importorskip("transformers")
capture_module = importlib.import_module("amp_compiler.frontend.capture")
BF16 = torch.bfloat16


def tiny_llama(layers: int, device=None, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return transformers.LlamaForCausalLM(config).eval()


def code(gm) -> str:
    """The generated code with the numbers of the sym_size_int nodes torch.export adds after tracing taken out: it
    counts them over what it traced before in the process (two full exports of one model can differ there)."""
    return re.sub(r"sym_size_int_\d+", "sym_size_int_#", gm.code)


def decisions(gm):
    return [(re.sub(r"sym_size_int_\d+", "sym_size_int_#", n.name), n.meta.get("amp", {}).get("op"), n.meta.get("amp", {}).get("precision"),
             n.meta.get("amp", {}).get("rule")) for n in gm.graph.nodes]


def spliced(gm) -> bool:
    return any("copied from block 2" in note for note in gm.meta["amp"]["notes"])


def exported_whole(monkeypatch):
    monkeypatch.setattr(capture_module, "repeated_blocks", lambda root: None)


IDS = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("layers", [9, 12])
def test_a_spliced_llama_is_the_graph_a_full_export_gives(layers, monkeypatch):
    model = tiny_llama(layers)
    fast = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=IDS)
    assert spliced(fast)
    with monkeypatch.context() as patch:
        exported_whole(patch)
        full = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=IDS)
    assert not spliced(full)
    assert code(fast) == code(full)
    assert decisions(fast) == decisions(full)
    assert fast.meta["amp"]["training_reads"] == full.meta["amp"]["training_reads"]   # every layer's, copied too
    assert len(fast.meta["amp"]["training_reads"]) >= layers
    assert torch.equal(fast(*IDS).logits, full(*IDS).logits)
    # each block reads its own parameters: a gradient reaches every layer's, and they differ
    fast(*IDS).logits.float().sum().backward()
    grads = [layer.mlp.down_proj.weight.grad for layer in model.model.layers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not torch.equal(grads[3], grads[4])


def test_fewer_blocks_than_the_minimum_are_exported_whole():
    assert not spliced(amp_compiler.convert(tiny_llama(repeated_blocks.MIN_BLOCKS - 1), "O1", dtype=BF16,
                                            example_inputs=IDS))


COUNT = 9


class Block(nn.Module):
    def __init__(self, index: int, rule: str, width: int = 8):
        super().__init__()
        self.index, self.rule = index, rule
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = torch.relu(self.linear(x))
        if self.rule == "odd" and self.index % 2 == 1:
            y = y * 2.0
        if self.rule == "last" and self.index == COUNT - 1:
            y = y - 1.0
        return x + y


class Stack(nn.Module):
    """Its shape test defeats torch.fx: convert() takes the torch.export path."""

    def __init__(self, rule: str, count: int = COUNT):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, rule) for i in range(count))

    def forward(self, x):
        if x.shape[0] > 1:
            x = x + 1.0
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("rule, copied", [("none", True), ("odd", False), ("last", False)])
def test_blocks_whose_graph_depends_on_their_index_are_exported_whole(rule, copied):
    torch.manual_seed(0)
    model = Stack(rule).eval()
    x = torch.randn(3, 8)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    assert gm.meta["amp"]["frontend"] == "torch.export"
    assert spliced(gm) is copied
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    torch.testing.assert_close(gm(x).float(), expected.float(), rtol=0.05, atol=0.05)


def test_blocks_that_differ_in_an_attribute_are_not_repeats():
    model = Stack("none")
    model.blocks[3].rule = "other"
    assert repeated_blocks.repeated_blocks(model) is None
    model.blocks[3].rule = "none"
    assert repeated_blocks.repeated_blocks(model).count == COUNT


def test_a_model_built_on_the_meta_device_converts_and_takes_real_weights():
    real = tiny_llama(9, seed=0)
    on_meta = tiny_llama(9, device="meta")
    expected = amp_compiler.convert(real, "O1", dtype=BF16, example_inputs=IDS)
    gm = amp_compiler.convert(on_meta, "O1", dtype=BF16, example_inputs=IDS)
    # tensor factories (arange) read the device of a parameter at call time: none is left on meta
    device = [n for n in gm.graph.nodes if n.target is getattr and n.args[1] == "device"]
    assert len(device) == 1 and device[0].users
    assert "device(type='meta')" not in gm.code
    # torch.export traces meta kernels there (their strides keep a .contiguous() the CPU trace drops): the
    # decisions of the nodes both graphs have agree
    ours = {d[0]: d for d in decisions(gm)}
    same = [d for d in decisions(expected) if d[0] in ours and d[1] == ours[d[0]][1]]
    assert len(same) > 0.9 * len(expected.graph.nodes)
    assert all(ours[d[0]] == d for d in same if d[1] in ("linear", "softmax", "sdpa", "embedding", "rms_norm"))
    gm.to_empty(device="cpu")
    missing, unexpected = gm.load_state_dict(real.state_dict(), strict=False)
    assert not unexpected
    for name, buffer in real.named_buffers():   # non-persistent buffers (rotary inv_freq) are not in a state_dict
        gm.get_buffer(name).copy_(buffer)
    assert not [n for n in missing if n not in dict(real.named_buffers())]
    assert torch.equal(gm(*IDS).logits, expected(*IDS).logits)


class PositionalStack(Stack):
    """Its loop knows each block's position: block 5 alone is doubled, which blocks 1, 2 and the last cannot show."""

    def forward(self, x):
        if x.shape[0] > 1:
            x = x + 1.0
        for i, block in enumerate(self.blocks):
            x = block(x) * (2.0 if i == 5 else 1.0)
        return x


def test_a_loop_that_reads_the_blocks_position_is_exported_whole():
    assert repeated_blocks.repeated_blocks(PositionalStack("none")) is None
    assert repeated_blocks.repeated_blocks(Stack("none")) is not None
    torch.manual_seed(0)
    model = PositionalStack("none").eval()
    x = torch.randn(3, 8)
    gm = amp_compiler.convert(model, "O1", dtype=BF16, example_inputs=(x,))
    assert not spliced(gm)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    torch.testing.assert_close(gm(x).float(), expected.float(), rtol=0.05, atol=0.05)
