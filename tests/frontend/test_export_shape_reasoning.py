"""torch.export's shape reasoning stays bounded: a dim whose sizes go through much integer arithmetic (Swin's
padded windows and patch merging) is fixed once torch has issued GUARDS_BEFORE_FIXED guards on it, with a note;
dims that need few guards stay dynamic."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_compiler import convert
from amp_compiler.frontend.export_capture import GUARDS_BEFORE_FIXED


class PaddedWindows(nn.Module):
    """Swin's shape arithmetic on a (B, H, W, C) input: pad to the window, partition into windows, merge back,
    unpad, merge 2x2 patches; `if window >= padded height` (torchvision's shift test) stops torch.fx."""

    def __init__(self, stages: int = 2, window: int = 4, channels: int = 8):
        super().__init__()
        self.window = window
        self.proj = nn.ModuleList(nn.Linear(channels, channels) for _ in range(stages))

    def forward(self, x):
        w = self.window
        for proj in self.proj:
            batch, height, width, channels = x.shape
            x = F.pad(x, (0, 0, 0, (w - width % w) % w, 0, (w - height % w) % w))
            _, padded_h, padded_w, _ = x.shape
            if w >= padded_h:
                x = x * 1.0
            x = x.view(batch, padded_h // w, w, padded_w // w, w, channels).permute(0, 1, 3, 2, 4, 5)
            x = proj(x.reshape(-1, w * w, channels))
            x = x.view(batch, padded_h // w, padded_w // w, w, w, channels).permute(0, 1, 3, 2, 4, 5)
            x = x.reshape(batch, padded_h, padded_w, channels)[:, :height, :width, :]
            x = F.pad(x, (0, 0, 0, width % 2, 0, height % 2))
            x = x[:, 0::2, 0::2] + x[:, 1::2, 1::2]
        return x


def test_dims_past_the_guard_limit_are_fixed_and_the_notes_say_why():
    # Before: both spatial dims stayed dynamic (190 guards on each, 48 s of export on 2 busy cores).
    torch.manual_seed(0)
    model = PaddedWindows().eval()
    x = torch.randn(1, 37, 45, 8)
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    amp = gm.meta["amp"]
    assert amp["frontend"] == "torch.export"
    costly = [note for note in amp["notes"] if f"passed {GUARDS_BEFORE_FIXED} guards" in note]
    assert costly and "x.size()[1], x.size()[2] fixed" in costly[0], amp["notes"]
    with torch.no_grad():
        torch.testing.assert_close(gm(x).float(), model(x), rtol=0.05, atol=0.05)
        with pytest.raises(ValueError, match=rf"has size 41 at dim 1.*passed {GUARDS_BEFORE_FIXED} guards"):
            gm(torch.randn(1, 41, 45, 8))


class Chunks(nn.Module):
    """A sequence cut into windows (local attention's layout): about 30 guards on the length."""

    def __init__(self, window: int = 4, channels: int = 8):
        super().__init__()
        self.window, self.proj = window, nn.Linear(channels, channels)

    def forward(self, x):
        batch, length, channels = x.shape
        if self.window >= length:
            x = x * 1.0
        chunks = self.proj(x.view(batch, length // self.window, self.window, channels))
        return chunks.reshape(batch, length, channels)


def test_dims_that_need_few_guards_stay_dynamic():
    torch.manual_seed(0)
    model = Chunks().eval()
    gm = convert(model, "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(2, 12, 8),))
    assert not [note for note in gm.meta["amp"]["notes"] if "guards each" in note], gm.meta["amp"]["notes"]
    other = torch.randn(3, 20, 8)    # a batch and a length the capture never saw
    with torch.no_grad():
        torch.testing.assert_close(gm(other).float(), model(other), rtol=0.05, atol=0.05)
