"""Children fx cannot trace, one fed an attribute of the other's output: `self.decoder(self.encoder(x).feature_maps)`.

fx makes the getattr node of `.feature_maps` when it is first used, which was inside the failed attempt to trace the
decoder: erased with it, and the decoder's opaque call read a deleted node ("Argument 'getattr_1' of Node
'amp_opaque_call_1' was used before it has been defined", a KeyError with example_inputs). Each failing torch.export
of such a model was also tried six times (repeated blocks, then whole; every dim dynamic, batch only, none).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import amp_compiler
from amp_testing import assert_close_to_fp32


@dataclasses.dataclass
class EncoderOutput:
    feature_maps: torch.Tensor
    pooled: torch.Tensor


class Encoder(nn.Module):
    def __init__(self, blocks: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(blocks))
        self.pool = nn.Linear(8, 8)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        if h.mean() > 0:   # data-dependent Python: neither front end captures this module
            h = h * 0.5
        return EncoderOutput(feature_maps=h, pooled=self.pool(h.mean((2, 3))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, maps):
        y = self.conv(maps)
        return y / 10 if y.abs().max() > 10 else y


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()

    def forward(self, x):
        return self.decoder(self.encoder(x).feature_maps)


@pytest.mark.parametrize("example", [False, True], ids=["no_example_inputs", "example_inputs"])
def test_an_untraceable_child_fed_an_attribute_of_another_ones_output_converts(example, monkeypatch):
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or export(*a, **k))
    model, x = EncoderDecoder().eval(), torch.randn(2, 3, 16, 16)
    gm = amp_compiler.convert(model, "O1", example_inputs=(x,) if example else None)
    assert set(gm.meta["amp"]["opaque"]) == {"encoder", "decoder"}   # each runs as written, under autocast
    assert_close_to_fp32(gm(x), model(x), torch.float16)
    amp_compiler.verify(gm, x)   # the encoder's dataclass comes back fp32, as recorded (its fields stayed low)
    assert len(exports) == (1 if example else 0)   # a branch on values: fewer dynamic dims cannot help (was 6)
