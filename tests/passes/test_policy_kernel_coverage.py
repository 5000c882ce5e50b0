"""issue 17: a decision never picks a dtype the target device has no kernel for.

Every op a level lets run in low precision (allow, infer and clear after the dtype overlay at O1; denied
ops too at O2 and O3) is called on small CPU tensors of that dtype, in each spelling a graph can record (F.pad's modes,
interpolate's modes, Tensor.unfold and F.unfold, ...). Either the kernel runs, or the CPU overlay of the
table keeps that op fp32 for that dtype. An op the table lets run low that this file cannot call is a
failure too: give it a sample below (or, when it is no kernel at all, a line in NOT_KERNELS).

Beside it: torchvision's S3D (avg_pool3d, which no CPU kernel runs in bf16 or fp16) converted at O1 bf16
on CPU runs, within 2x torch.autocast's error against fp32.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler.passes.policy.op_policy import DEVICE_OVERLAYS
from amp_compiler.passes.policy.rules import PrecisionRules
from models.torchvision_ops import import_torchvision

LOW_CLASSES = ("allow", "infer", "clear")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Canonical ops the table lets run low that are no kernel of their own.
NOT_KERNELS = {
    "cond": "control flow: its branches' ops are painted (and called here) one by one",
    "identity": "returns its input",
}


def r(*shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def idx(*shape, high):
    return torch.randint(high, shape, generator=torch.Generator().manual_seed(1))


def spd(d):
    """A well-conditioned symmetric positive definite 4x4 matrix (the linalg samples)."""
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    return (a @ a.T + 4 * torch.eye(4)).to(d)


def _unary(f, positive=False):
    return [lambda d: f(r(2, 3, 4, dtype=d).abs() + 0.5 if positive else r(2, 3, 4, dtype=d) * 0.5)]


def P(d, *shape):
    return r(*shape, dtype=d).softmax(-1)


def T(*shape):
    return idx(*shape, high=3)


def _module(make, *shape):
    def call(d):
        torch.manual_seed(0)
        return make().to(d)(r(*shape, dtype=d))
    return call


def _grouped_mm(grouped_mm, d):
    """Mixture-of-experts matmul: 16 tokens sorted by expert, 2 experts (offsets 8 and 16)."""
    return grouped_mm(r(16, 16, dtype=d), r(2, 16, 8, dtype=d), offs=torch.tensor([8, 16], dtype=torch.int32))


def _transformers_grouped_mm():
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback
    return torch.ops.transformers.grouped_mm_fallback


# canonical op -> calls that reach each of its kernels, given the low dtype
SAMPLES = {
    # allow
    "linear": [lambda d: F.linear(r(2, 4, dtype=d), r(3, 4, dtype=d), r(3, dtype=d))],
    "matmul": [lambda d: r(2, 3, 4, dtype=d) @ r(4, 5, dtype=d)],
    "mm": [lambda d: torch.mm(r(3, 4, dtype=d), r(4, 5, dtype=d))],
    "bmm": [lambda d: torch.bmm(r(2, 3, 4, dtype=d), r(2, 4, 5, dtype=d))],
    "mv": [lambda d: torch.mv(r(3, 4, dtype=d), r(4, dtype=d))],
    "addmm": [lambda d: torch.addmm(r(3, 5, dtype=d), r(3, 4, dtype=d), r(4, 5, dtype=d))],
    "addmv": [lambda d: torch.addmv(r(3, dtype=d), r(3, 4, dtype=d), r(4, dtype=d))],
    "addr": [lambda d: torch.addr(r(3, 4, dtype=d), r(3, dtype=d), r(4, dtype=d))],
    "addbmm": [lambda d: torch.addbmm(r(3, 5, dtype=d), r(2, 3, 4, dtype=d), r(2, 4, 5, dtype=d))],
    "baddbmm": [lambda d: torch.baddbmm(r(2, 3, 5, dtype=d), r(2, 3, 4, dtype=d), r(2, 4, 5, dtype=d))],
    "einsum": [lambda d: torch.einsum("bij,bjk->bik", r(2, 3, 4, dtype=d), r(2, 4, 5, dtype=d))],
    "chain_matmul": [lambda d: torch.linalg.multi_dot([r(3, 4, dtype=d), r(4, 5, dtype=d), r(5, 2, dtype=d)])],
    "multi_dot": [lambda d: torch.linalg.multi_dot([r(3, 4, dtype=d), r(4, 5, dtype=d), r(5, 2, dtype=d)])],
    "bilinear": [lambda d: F.bilinear(r(2, 3, dtype=d), r(2, 4, dtype=d), r(5, 3, 4, dtype=d), r(5, dtype=d))],
    "tensordot": [lambda d: torch.tensordot(r(2, 3, 4, dtype=d), r(3, 4, 5, dtype=d), dims=2)],
    "conv1d": [lambda d: F.conv1d(r(1, 2, 8, dtype=d), r(3, 2, 3, dtype=d), r(3, dtype=d))],
    "conv2d": [lambda d: F.conv2d(r(1, 2, 8, 8, dtype=d), r(3, 2, 3, 3, dtype=d), r(3, dtype=d)),
               lambda d: F.conv2d(r(1, 4, 8, 8, dtype=d), r(4, 1, 3, 3, dtype=d), groups=4)],
    "conv3d": [lambda d: F.conv3d(r(1, 2, 4, 6, 6, dtype=d), r(3, 2, 3, 3, 3, dtype=d), r(3, dtype=d))],
    "conv_transpose1d": [lambda d: F.conv_transpose1d(r(1, 2, 8, dtype=d), r(2, 3, 3, dtype=d))],
    "conv_transpose2d": [lambda d: F.conv_transpose2d(r(1, 2, 8, 8, dtype=d), r(2, 3, 3, 3, dtype=d))],
    "conv_transpose3d": [lambda d: F.conv_transpose3d(r(1, 2, 4, 6, 6, dtype=d), r(2, 3, 3, 3, 3, dtype=d))],
    "convolution": [lambda d: torch.convolution(r(1, 2, 8, 8, dtype=d), r(3, 2, 3, 3, dtype=d), None,
                                                [1, 1], [1, 1], [1, 1], False, [0, 0], 1)],
    "conv_tbc": [lambda d: torch.conv_tbc(r(8, 2, 3, dtype=d), r(3, 3, 4, dtype=d), r(4, dtype=d), 1)],
    "scaled_dot_product_attention": [
        lambda d: F.scaled_dot_product_attention(r(2, 2, 5, 8, dtype=d), r(2, 2, 5, 8, dtype=d), r(2, 2, 5, 8, dtype=d)),
        lambda d: F.scaled_dot_product_attention(r(2, 2, 5, 8, dtype=d), r(2, 2, 5, 8, dtype=d), r(2, 2, 5, 8, dtype=d),
                                                 attn_mask=r(5, 5, dtype=d), dropout_p=0.1)],
    "prelu": [lambda d: F.prelu(r(2, 3, 4, dtype=d), r(3, dtype=d))],
    "grouped_mm": [lambda d: _grouped_mm(torch._grouped_mm, d)],
    "grouped_mm_fallback": [lambda d: _grouped_mm(_transformers_grouped_mm(), d)],
    "lstm": [_module(lambda: nn.LSTM(4, 3, batch_first=True), 2, 5, 4)],
    "gru": [_module(lambda: nn.GRU(4, 3, bidirectional=True), 5, 2, 4)],
    "rnn": [_module(lambda: nn.RNN(4, 3), 5, 2, 4)],
    "rnn_tanh": [_module(lambda: nn.RNN(4, 3, nonlinearity="tanh"), 5, 2, 4)],
    "rnn_relu": [_module(lambda: nn.RNN(4, 3, nonlinearity="relu"), 5, 2, 4)],
    "lstm_cell": [_module(lambda: nn.LSTMCell(4, 3), 2, 4)],
    "gru_cell": [_module(lambda: nn.GRUCell(4, 3), 2, 4)],
    "rnn_tanh_cell": [_module(lambda: nn.RNNCell(4, 3), 2, 4)],
    "rnn_relu_cell": [_module(lambda: nn.RNNCell(4, 3, nonlinearity="relu"), 2, 4)],
    # infer: arithmetic
    "add": [lambda d: r(2, 3, dtype=d) + r(3, dtype=d), lambda d: r(2, 3, dtype=d).add(2.5, alpha=2)],
    "sub": [lambda d: r(2, 3, dtype=d) - r(3, dtype=d)],
    "rsub": [lambda d: torch.rsub(r(2, 3, dtype=d), 1.0)],
    "mul": [lambda d: r(2, 3, dtype=d) * r(3, dtype=d)],
    "div": [lambda d: r(2, 3, dtype=d) / r(3, dtype=d), lambda d: torch.div(r(2, 3, dtype=d), 2, rounding_mode="floor")],
    "true_divide": [lambda d: torch.true_divide(r(2, 3, dtype=d), r(3, dtype=d))],
    "floordiv": [lambda d: operator.floordiv(r(2, 3, dtype=d), r(3, dtype=d))],
    "floor_divide": [lambda d: torch.floor_divide(r(2, 3, dtype=d), r(3, dtype=d))],
    "mod": [lambda d: operator.mod(r(2, 3, dtype=d), 0.7)],
    "remainder": [lambda d: torch.remainder(r(2, 3, dtype=d), r(3, dtype=d))],
    "fmod": [lambda d: torch.fmod(r(2, 3, dtype=d), 0.7)],
    "neg": [lambda d: torch.neg(r(2, 3, dtype=d))],
    "addcmul": [lambda d: torch.addcmul(r(2, 3, dtype=d), r(2, 3, dtype=d), r(2, 3, dtype=d), value=0.5)],
    "addcdiv": [lambda d: torch.addcdiv(r(2, 3, dtype=d), r(2, 3, dtype=d), r(2, 3, dtype=d) + 3, value=0.5)],
    "lerp": [lambda d: torch.lerp(r(2, 3, dtype=d), r(2, 3, dtype=d), 0.3),
             lambda d: torch.lerp(r(2, 3, dtype=d), r(2, 3, dtype=d), r(2, 3, dtype=d))],
    "square": [lambda d: torch.square(r(2, 3, dtype=d))],
    "sqrt": [lambda d: torch.sqrt(r(2, 3, dtype=d).abs())],
    "clamp": [lambda d: torch.clamp(r(2, 3, dtype=d), -0.5, 0.5),
              lambda d: torch.clamp(r(2, 3, dtype=d), r(2, 3, dtype=d), r(2, 3, dtype=d) + 1)],
    "clip": [lambda d: torch.clip(r(2, 3, dtype=d), -0.5, 0.5)],
    "clamp_min": [lambda d: torch.clamp_min(r(2, 3, dtype=d), 0.1)],
    "clamp_max": [lambda d: torch.clamp_max(r(2, 3, dtype=d), 0.1)],
    "diff": [lambda d: torch.diff(r(2, 5, dtype=d), dim=-1)],
    "pow": [lambda d: torch.pow(r(2, 3, dtype=d), 2), lambda d: torch.pow(r(2, 3, dtype=d).abs(), r(2, 3, dtype=d)),
            lambda d: torch.pow(2.0, r(2, 3, dtype=d))],
    "exp2": [lambda d: torch.exp2(r(2, 3, dtype=d))],
    # infer: activations and bounded functions
    **{name: [lambda d, f=getattr(F, name): f(r(2, 3, 4, dtype=d))]
       for name in ("gelu", "silu", "sigmoid", "tanh", "hardtanh", "hardsigmoid", "hardswish", "mish", "elu",
                    "selu", "celu", "leaky_relu", "logsigmoid", "softsign", "tanhshrink")},
    **{name: [lambda d, f=getattr(torch, name): f(r(2, 3, 4, dtype=d))] for name in ("erf", "erfc", "sin", "cos", "atan")},
    "atan2": [lambda d: torch.atan2(r(2, 3, dtype=d), r(2, 3, dtype=d))],
    # infer: averages
    "avg_pool1d": [lambda d: F.avg_pool1d(r(1, 2, 8, dtype=d), 2)],
    "avg_pool2d": [lambda d: F.avg_pool2d(r(1, 2, 8, 8, dtype=d), 2),
                   lambda d: F.avg_pool2d(r(1, 2, 8, 8, dtype=d).to(memory_format=torch.channels_last), 3, 1, 1)],
    "avg_pool3d": [lambda d: F.avg_pool3d(r(1, 2, 4, 8, 8, dtype=d), 2),
                   lambda d: F.avg_pool3d(r(1, 2, 4, 8, 8, dtype=d).to(memory_format=torch.channels_last_3d), 2)],
    "adaptive_avg_pool1d": [lambda d: F.adaptive_avg_pool1d(r(1, 2, 8, dtype=d), 3)],
    "adaptive_avg_pool2d": [lambda d: F.adaptive_avg_pool2d(r(1, 2, 8, 8, dtype=d), 1),
                            lambda d: F.adaptive_avg_pool2d(r(1, 2, 8, 8, dtype=d), 3)],
    "adaptive_avg_pool3d": [lambda d: F.adaptive_avg_pool3d(r(1, 2, 4, 8, 8, dtype=d), 1),
                            lambda d: F.adaptive_avg_pool3d(r(1, 2, 4, 8, 8, dtype=d), 3)],
    "mean": [lambda d: r(2, 3, 4, dtype=d).mean(), lambda d: r(2, 3, 4, dtype=d).mean(dim=(1, 2), keepdim=True)],
    # resampling (infer in bf16 only)
    "interpolate": [lambda d, mode=mode, shape=shape: F.interpolate(r(1, 2, *shape, dtype=d), scale_factor=2, mode=mode)
                    for mode, shape in (("nearest", (4, 4)), ("nearest-exact", (4, 4)), ("bilinear", (4, 4)),
                                        ("bicubic", (4, 4)), ("linear", (4,)), ("trilinear", (2, 4, 4)),
                                        ("nearest", (2, 4, 4)), ("area", (4, 4)))],
    "upsample_nearest2d": [lambda d: F.interpolate(r(1, 2, 4, 4, dtype=d), scale_factor=2)],
    "upsample_bilinear2d": [lambda d: F.interpolate(r(1, 2, 4, 4, dtype=d), scale_factor=2, mode="bilinear",
                                                    align_corners=True)],
    # clear: data movement
    "view": [lambda d: r(2, 6, dtype=d).view(3, 4)],
    "reshape": [lambda d: r(2, 6, dtype=d).reshape(3, 4)],
    "flatten": [lambda d: r(2, 3, 4, dtype=d).flatten(1)],
    "unflatten": [lambda d: r(2, 12, dtype=d).unflatten(1, (3, 4))],
    "squeeze": [lambda d: r(2, 1, 3, dtype=d).squeeze(1)],
    "unsqueeze": [lambda d: r(2, 3, dtype=d).unsqueeze(0)],
    "transpose": [lambda d: r(2, 3, dtype=d).transpose(0, 1)],
    "permute": [lambda d: r(2, 3, 4, dtype=d).permute(2, 0, 1)],
    "t": [lambda d: r(2, 3, dtype=d).t()],
    "contiguous": [lambda d: r(2, 3, dtype=d).t().contiguous()],
    "expand": [lambda d: r(1, 3, dtype=d).expand(4, 3)],
    "expand_as": [lambda d: r(1, 3, dtype=d).expand_as(r(4, 3, dtype=d))],
    "repeat": [lambda d: r(2, 3, dtype=d).repeat(2, 1)],
    "tile": [lambda d: torch.tile(r(2, 3, dtype=d), (2,))],
    "narrow": [lambda d: r(4, 3, dtype=d).narrow(0, 1, 2)],
    "select": [lambda d: r(4, 3, dtype=d).select(0, 1)],
    "slice": [lambda d: r(4, 3, dtype=d)[1:3]],
    "getitem": [lambda d: r(4, 3, dtype=d)[1]],
    "split": [lambda d: r(4, 3, dtype=d).split(2)],
    "chunk": [lambda d: r(4, 3, dtype=d).chunk(2)],
    "unbind": [lambda d: r(4, 3, dtype=d).unbind(0)],
    "cat": [lambda d: torch.cat([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "concat": [lambda d: torch.concat([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "concatenate": [lambda d: torch.concatenate([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "stack": [lambda d: torch.stack([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "hstack": [lambda d: torch.hstack([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "vstack": [lambda d: torch.vstack([r(2, 3, dtype=d), r(2, 3, dtype=d)])],
    "flip": [lambda d: torch.flip(r(2, 3, dtype=d), (1,))],
    "roll": [lambda d: torch.roll(r(2, 3, dtype=d), 1, 1)],
    "movedim": [lambda d: torch.movedim(r(2, 3, 4, dtype=d), 0, 2)],
    "swapaxes": [lambda d: torch.swapaxes(r(2, 3, dtype=d), 0, 1)],
    "unfold": [lambda d: r(2, 8, dtype=d).unfold(1, 3, 2), lambda d: F.unfold(r(1, 2, 6, 6, dtype=d), 3)],
    "pad": [lambda d, mode=mode, shape=shape: F.pad(r(1, 2, *shape, dtype=d), (1, 1) * len(shape), mode=mode)
            for mode in ("constant", "reflect", "replicate", "circular") for shape in ((6,), (6, 6), (4, 6, 6))],
    "pixel_shuffle": [lambda d: F.pixel_shuffle(r(1, 8, 3, 3, dtype=d), 2)],
    "pixel_unshuffle": [lambda d: F.pixel_unshuffle(r(1, 2, 4, 4, dtype=d), 2)],
    "channel_shuffle": [lambda d: F.channel_shuffle(r(1, 4, 3, 3, dtype=d), 2),
                        lambda d: nn.ChannelShuffle(2)(r(1, 4, 3, 3, dtype=d))],
    "clone": [lambda d: r(2, 3, dtype=d).clone()],
    "detach": [lambda d: r(2, 3, dtype=d).detach()],
    "alias": [lambda d: torch.ops.aten.alias(r(2, 3, dtype=d))],
    "view_as": [lambda d: r(2, 6, dtype=d).view_as(r(3, 4, dtype=d))],
    "reshape_as": [lambda d: r(2, 6, dtype=d).reshape_as(r(3, 4, dtype=d))],
    "index_select": [lambda d: torch.index_select(r(4, 3, dtype=d), 0, idx(5, high=4))],
    "gather": [lambda d: torch.gather(r(4, 3, dtype=d), 1, idx(4, 2, high=3))],
    "take": [lambda d: torch.take(r(4, 3, dtype=d), idx(5, high=12))],
    "take_along_dim": [lambda d: torch.take_along_dim(r(4, 3, dtype=d), idx(4, 2, high=3), dim=1)],
    "masked_select": [lambda d: torch.masked_select(r(4, 3, dtype=d), r(4, 3, dtype=torch.float32) > 0)],
    "index": [lambda d: r(4, 3, dtype=d)[idx(5, high=4)], lambda d: r(4, 3, dtype=d)[r(4, 3, dtype=torch.float32) > 0]],
    "diagonal": [lambda d: torch.diagonal(r(4, 4, dtype=d))],
    "meshgrid": [lambda d: torch.meshgrid(r(3, dtype=d), r(4, dtype=d), indexing="ij")],
    "tril": [lambda d: torch.tril(r(4, 4, dtype=d))],
    "triu": [lambda d: torch.triu(r(4, 4, dtype=d))],
    # clear: selection
    "relu": [lambda d: F.relu(r(2, 3, dtype=d))],
    "relu6": [lambda d: F.relu6(r(2, 3, dtype=d))],
    "threshold": [lambda d: F.threshold(r(2, 3, dtype=d), 0.1, 0.0)],
    "hardshrink": [lambda d: F.hardshrink(r(2, 3, dtype=d))],
    "softshrink": [lambda d: F.softshrink(r(2, 3, dtype=d))],
    "max": [lambda d: r(2, 3, dtype=d).max(), lambda d: r(2, 3, dtype=d).max(dim=1),
            lambda d: torch.max(r(2, 3, dtype=d), r(2, 3, dtype=d))],
    "min": [lambda d: r(2, 3, dtype=d).min(), lambda d: r(2, 3, dtype=d).min(dim=1)],
    "amax": [lambda d: r(2, 3, dtype=d).amax(1)],
    "amin": [lambda d: r(2, 3, dtype=d).amin(1)],
    "maximum": [lambda d: torch.maximum(r(2, 3, dtype=d), r(2, 3, dtype=d))],
    "minimum": [lambda d: torch.minimum(r(2, 3, dtype=d), r(2, 3, dtype=d))],
    "max_pool1d": [lambda d: F.max_pool1d(r(1, 2, 8, dtype=d), 2)],
    "max_pool2d": [lambda d: F.max_pool2d(r(1, 2, 8, 8, dtype=d), 3, 2, 1),
                   lambda d: F.max_pool2d(r(1, 2, 8, 8, dtype=d), 2, return_indices=True)],
    "max_pool3d": [lambda d: F.max_pool3d(r(1, 2, 4, 8, 8, dtype=d), 2),
                   lambda d: F.max_pool3d(r(1, 2, 4, 8, 8, dtype=d), 2, return_indices=True)],
    "adaptive_max_pool1d": [lambda d: F.adaptive_max_pool1d(r(1, 2, 8, dtype=d), 3)],
    "adaptive_max_pool2d": [lambda d: F.adaptive_max_pool2d(r(1, 2, 8, 8, dtype=d), 3)],
    "adaptive_max_pool3d": [lambda d: F.adaptive_max_pool3d(r(1, 2, 4, 8, 8, dtype=d), 3)],
    "where": [lambda d: torch.where(r(2, 3, dtype=torch.float32) > 0, r(2, 3, dtype=d), r(2, 3, dtype=d))],
    "masked_fill": [lambda d: r(2, 3, dtype=d).masked_fill(r(2, 3, dtype=torch.float32) > 0, -1e4)],
    **{name: [lambda d, f=getattr(F, name): f(r(2, 4, 3, 3, dtype=d), 0.3, training=True)]
       for name in ("dropout", "dropout2d", "alpha_dropout", "feature_alpha_dropout")},
    "dropout1d": [lambda d: F.dropout1d(r(2, 4, 3, dtype=d), 0.3, training=True)],
    "dropout3d": [lambda d: F.dropout3d(r(2, 4, 3, 3, 3, dtype=d), 0.3, training=True)],
    **{name: [lambda d, f=getattr(torch, name): f(r(2, 3, dtype=d))]
       for name in ("abs", "sign", "round", "floor", "ceil", "trunc", "nan_to_num", "zeros_like", "ones_like",
                    "empty_like", "rand_like", "randn_like")},
    "full_like": [lambda d: torch.full_like(r(2, 3, dtype=d), 2.0)],
    "sort": [lambda d: torch.sort(r(2, 5, dtype=d), dim=1)],
    "topk": [lambda d: torch.topk(r(2, 5, dtype=d), 2)],
    "kthvalue": [lambda d: torch.kthvalue(r(2, 5, dtype=d), 2)],
    "median": [lambda d: torch.median(r(2, 5, dtype=d)), lambda d: torch.median(r(2, 5, dtype=d), dim=1)],
    "scatter": [lambda d: torch.scatter(r(4, 3, dtype=d), 0, idx(2, 3, high=4), r(2, 3, dtype=d))],
    "scatter_add": [lambda d: torch.scatter_add(r(4, 3, dtype=d), 0, idx(2, 3, high=4), r(2, 3, dtype=d))],
    "index_add": [lambda d: torch.index_add(r(4, 3, dtype=d), 0, idx(5, high=4), r(5, 3, dtype=d))],
    "index_put": [lambda d: r(4, 3, dtype=d).index_put((idx(2, high=4),), r(2, 3, dtype=d))],
    "index_copy": [lambda d: torch.index_copy(r(4, 3, dtype=d), 0, torch.tensor([2, 0]), r(2, 3, dtype=d))],
    "masked_scatter": [lambda d: r(4, 3, dtype=d).masked_scatter(r(4, 3, dtype=torch.float32) > 0, r(4, 3, dtype=d))],
    # deny: what O2 and O3 run low (norms with fp32 weights too: O1/O2's mixed kernels)
    **{n: _unary(getattr(torch, n)) for n in ("exp", "expm1", "exp2", "acos", "asin", "cosh", "sinh", "tan", "erfinv")},
    **{n: _unary(getattr(torch, n), positive=True) for n in ("log", "log2", "log10", "log1p", "reciprocal", "rsqrt", "lgamma", "digamma")},
    "softplus": _unary(F.softplus),
    "float_power": [lambda d: torch.float_power(r(2, 3, dtype=d).abs(), 2)],
    "sum": [lambda d: r(2, 3, dtype=d).sum(), lambda d: r(2, 3, dtype=d).sum(1)],
    "prod": [lambda d: r(2, 3, dtype=d).prod(1)],
    "cumsum": [lambda d: r(2, 3, dtype=d).cumsum(1)], "cumprod": [lambda d: r(2, 3, dtype=d).cumprod(1)],
    "logsumexp": [lambda d: r(2, 3, dtype=d).logsumexp(1)],
    "std": [lambda d: r(2, 3, dtype=d).std(1)], "var": [lambda d: r(2, 3, dtype=d).var(1)],
    "var_mean": [lambda d: torch.var_mean(r(2, 3, dtype=d), 1)], "std_mean": [lambda d: torch.std_mean(r(2, 3, dtype=d), 1)],
    "norm": [lambda d: r(2, 3, dtype=d).norm(dim=1), lambda d: torch.norm(r(2, 3, dtype=d))],
    "vector_norm": [lambda d: torch.linalg.vector_norm(r(2, 3, dtype=d), dim=1)],
    "matrix_norm": [lambda d: torch.linalg.matrix_norm(r(3, 3, dtype=d))],
    "frobenius_norm": [lambda d: torch.linalg.matrix_norm(r(3, 3, dtype=d), "fro")],
    "nuclear_norm": [lambda d: torch.linalg.matrix_norm(r(3, 3, dtype=d), "nuc")],
    "renorm": [lambda d: torch.renorm(r(2, 3, dtype=d), 2, 0, 1.0)],
    "normalize": [lambda d: F.normalize(r(2, 3, dtype=d), dim=1)],
    "cosine_similarity": [lambda d: F.cosine_similarity(r(2, 3, dtype=d), r(2, 3, dtype=d, seed=1))],
    "dist": [lambda d: torch.dist(r(2, 3, dtype=d), r(2, 3, dtype=d, seed=1))],
    "pdist": [lambda d: F.pdist(r(4, 3, dtype=d))],
    "cdist": [lambda d: torch.cdist(r(4, 3, dtype=d), r(5, 3, dtype=d, seed=1))],
    "trace": [lambda d: torch.trace(r(3, 3, dtype=d))],
    "batch_norm": [lambda d: F.batch_norm(r(2, 3, 4, dtype=d), r(3, dtype=d), r(3, dtype=d).abs(), r(3, dtype=d), r(3, dtype=d)),
                   lambda d: F.batch_norm(r(2, 3, 4, dtype=d), r(3, dtype=torch.float32), r(3, dtype=torch.float32).abs(),
                                          r(3, dtype=torch.float32), r(3, dtype=torch.float32)),
                   lambda d: F.batch_norm(r(2, 3, 4, dtype=d), None, None, training=True)],
    "layer_norm": [lambda d: F.layer_norm(r(2, 3, 4, dtype=d), (4,), r(4, dtype=d), r(4, dtype=d)),
                   lambda d: F.layer_norm(r(2, 3, 4, dtype=d), (4,), r(4, dtype=torch.float32), r(4, dtype=torch.float32))],
    "group_norm": [lambda d: F.group_norm(r(2, 4, 3, dtype=d), 2, r(4, dtype=d), r(4, dtype=d)),
                   lambda d: F.group_norm(r(2, 4, 3, dtype=d), 2, r(4, dtype=torch.float32), r(4, dtype=torch.float32))],
    "instance_norm": [lambda d: F.instance_norm(r(2, 3, 4, 4, dtype=d))],
    "rms_norm": [lambda d: F.rms_norm(r(2, 3, 4, dtype=d), (4,), r(4, dtype=d))],
    "local_response_norm": [lambda d: F.local_response_norm(r(2, 4, 3, 3, dtype=d), 2)],
    "softmax": [lambda d: r(2, 3, dtype=d).softmax(-1)], "log_softmax": [lambda d: r(2, 3, dtype=d).log_softmax(-1)],
    "softmin": [lambda d: F.softmin(r(2, 3, dtype=d), -1)],
    "cross_entropy": [lambda d: F.cross_entropy(r(4, 3, dtype=d), T(4)), lambda d: F.cross_entropy(r(4, 3, dtype=d), P(d, 4, 3))],
    "nll_loss": [lambda d: F.nll_loss(r(4, 3, dtype=d).log_softmax(-1), T(4)), lambda d: F.nll_loss(r(2, 3, 4, 4, dtype=d), idx(2, 4, 4, high=3))],
    "mse_loss": [lambda d: F.mse_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1))],
    "l1_loss": [lambda d: F.l1_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1))],
    "smooth_l1_loss": [lambda d: F.smooth_l1_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1))],
    "huber_loss": [lambda d: F.huber_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1))],
    "kl_div": [lambda d: F.kl_div(r(4, 3, dtype=d).log_softmax(-1), P(d, 4, 3), reduction="batchmean")],
    "binary_cross_entropy": [lambda d: F.binary_cross_entropy(r(4, 3, dtype=d).sigmoid(), r(4, 3, dtype=d, seed=1).sigmoid())],
    "binary_cross_entropy_with_logits": [lambda d: F.binary_cross_entropy_with_logits(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1).sigmoid())],
    "poisson_nll_loss": [lambda d: F.poisson_nll_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1).abs())],
    "gaussian_nll_loss": [lambda d: F.gaussian_nll_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1), r(4, 3, dtype=d).abs() + 0.1)],
    "cosine_embedding_loss": [lambda d: F.cosine_embedding_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1), torch.ones(4))],
    "hinge_embedding_loss": [lambda d: F.hinge_embedding_loss(r(4, 3, dtype=d), torch.ones(4, 3))],
    "margin_ranking_loss": [lambda d: F.margin_ranking_loss(r(4, dtype=d), r(4, dtype=d, seed=1), torch.ones(4))],
    "multi_margin_loss": [lambda d: F.multi_margin_loss(r(4, 3, dtype=d), T(4))],
    "multilabel_margin_loss": [lambda d: F.multilabel_margin_loss(r(4, 3, dtype=d), T(4, 3))],
    "multilabel_soft_margin_loss": [lambda d: F.multilabel_soft_margin_loss(r(4, 3, dtype=d), torch.ones(4, 3))],
    "soft_margin_loss": [lambda d: F.soft_margin_loss(r(4, 3, dtype=d), torch.ones(4, 3))],
    "triplet_margin_loss": [lambda d: F.triplet_margin_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1), r(4, 3, dtype=d, seed=2))],
    "triplet_margin_with_distance_loss": [lambda d: F.triplet_margin_with_distance_loss(r(4, 3, dtype=d), r(4, 3, dtype=d, seed=1), r(4, 3, dtype=d, seed=2))],
    "ctc_loss": [lambda d: F.ctc_loss(r(6, 2, 4, dtype=d).log_softmax(-1), idx(2, 3, high=3) + 1, torch.tensor([6, 6]), torch.tensor([3, 2]))],
    "upsample": [lambda d: nn.Upsample(scale_factor=2)(r(1, 2, 4, 4, dtype=d))],
    "upsample_nearest1d": [lambda d: F.interpolate(r(1, 2, 4, dtype=d), scale_factor=2)],
    "upsample_nearest3d": [lambda d: F.interpolate(r(1, 2, 2, 4, 4, dtype=d), scale_factor=2)],
    "upsample_linear1d": [lambda d: F.interpolate(r(1, 2, 4, dtype=d), scale_factor=2, mode="linear")],
    "upsample_bicubic2d": [lambda d: F.interpolate(r(1, 2, 4, 4, dtype=d), scale_factor=2, mode="bicubic")],
    "upsample_trilinear3d": [lambda d: F.interpolate(r(1, 2, 2, 4, 4, dtype=d), scale_factor=2, mode="trilinear")],
    "grid_sample": [lambda d, mode=mode: F.grid_sample(r(1, 2, 4, 4, dtype=d), r(1, 3, 3, 2, dtype=d).tanh(), mode=mode, align_corners=False)
                    for mode in ("bilinear", "nearest", "bicubic")] + [lambda d: F.grid_sample(r(1, 2, 2, 4, 4, dtype=d), r(1, 2, 3, 3, 3, dtype=d).tanh(), align_corners=False)],
    "grid_sampler": [lambda d: torch.grid_sampler(r(1, 2, 4, 4, dtype=d), r(1, 3, 3, 2, dtype=d).tanh(), 0, 0, False)],
    "affine_grid": [lambda d: F.affine_grid(r(1, 2, 3, dtype=d), [1, 2, 4, 4], align_corners=False)],
    "inverse": [lambda d: torch.linalg.inv(spd(d))], "det": [lambda d: torch.linalg.det(spd(d))],
    "logdet": [lambda d: torch.logdet(spd(d))], "slogdet": [lambda d: torch.linalg.slogdet(spd(d))],
    "solve": [lambda d: torch.linalg.solve(spd(d), r(4, 2, dtype=d))], "cholesky": [lambda d: torch.linalg.cholesky(spd(d))],
    "qr": [lambda d: torch.linalg.qr(spd(d))], "svd": [lambda d: torch.linalg.svd(spd(d))],
    "eig": [lambda d: torch.linalg.eig(spd(d))], "eigh": [lambda d: torch.linalg.eigh(spd(d))],
    "lstsq": [lambda d: torch.linalg.lstsq(spd(d), r(4, 2, dtype=d))], "pinverse": [lambda d: torch.linalg.pinv(spd(d))],
    "matrix_exp": [lambda d: torch.linalg.matrix_exp(spd(d) / 10)],
    "fft": [lambda d: torch.fft.fft(r(2, 8, dtype=d))], "ifft": [lambda d: torch.fft.ifft(r(2, 8, dtype=d))],
    "rfft": [lambda d: torch.fft.rfft(r(2, 8, dtype=d))], "irfft": [lambda d: torch.fft.irfft(r(2, 8, dtype=d))],
    "fft2": [lambda d: torch.fft.fft2(r(2, 8, 8, dtype=d))],
    "stft": [lambda d: torch.stft(r(2, 64, dtype=d), 16, window=torch.hann_window(16).to(d), return_complex=True)],
    "istft": [lambda d: torch.istft(torch.stft(r(2, 64, dtype=torch.float32), 16, window=torch.hann_window(16),
                                               return_complex=True), 16, window=torch.hann_window(16).to(d))],
    "scatter_reduce": [lambda d, red=red: torch.scatter_reduce(r(4, 3, dtype=d), 0, idx(2, 3, high=4), r(2, 3, dtype=d), red)
                       for red in ("sum", "prod", "mean", "amax", "amin")],
    "index_reduce": [lambda d: torch.index_reduce(r(4, 3, dtype=d), 0, idx(5, high=4), r(5, 3, dtype=d), "prod")],
    "embedding_bag": [lambda d: F.embedding_bag(idx(2, 3, high=5), r(5, 4, dtype=d), mode="mean")],
    "segment_reduce": [lambda d: torch.segment_reduce(r(6, dtype=d), "sum", lengths=torch.tensor([2, 4]))],
    "histc": [lambda d: torch.histc(r(20, dtype=d), bins=4)],
    "bincount": [lambda d: torch.bincount(idx(10, high=4), weights=r(10, dtype=d))],
    "weight_norm": [lambda d: torch._weight_norm(r(3, 4, dtype=d), r(3, 1, dtype=d), 0)],
}


LEVELS = ("O1", "O2", "O3")   # O2/O3 run denied ops low too (norms, softmax, reductions, linalg, FFT...)


def _low_ops(level: str, dtype_name: str, devices=()) -> list[str]:
    """The ops the rules of `level` let run in `dtype_name` (on `devices`)."""
    table = PrecisionRules.build(level, dtype_name, devices=devices).table
    return sorted(op for op, (op_class, _family, _reason) in table.items() if op_class in LOW_CLASSES)


def _missing_kernel(call, dtype_name: str) -> str | None:
    """The error of a call that runs in fp32 and fails in the low dtype (the CPU has no kernel for it), or
    None when it runs. A call that fails in fp32 too is the sample's own mistake: raised."""
    try:
        with torch.no_grad():
            call(DTYPES[dtype_name])
    except (RuntimeError, NotImplementedError) as error:
        with torch.no_grad():
            call(torch.float32)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    return None


def test_every_op_a_level_runs_low_has_a_sample_here():
    missing = {op for level in LEVELS for name in DTYPES for op in _low_ops(level, name)
               if op not in SAMPLES and op not in NOT_KERNELS}
    assert not missing, f"ops a level lets run low with no sample call in this file: {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_op_a_level_runs_low_has_a_cpu_kernel_or_stays_fp32_on_cpu(dtype_name):
    """The kernel runs in the low dtype on CPU (each spelling), or the CPU overlay keeps the op fp32 there,
    at every level."""
    no_kernel = {}
    for op in sorted({op for level in LEVELS for op in _low_ops(level, dtype_name)}):
        for call in SAMPLES.get(op, ()):
            why = _missing_kernel(call, dtype_name)
            if why:
                no_kernel[op] = why
                break
    for level in LEVELS:
        on_cpu = set(_low_ops(level, dtype_name, devices=("cpu",)))
        wrong = {op: why for op, why in no_kernel.items() if op in on_cpu}
        assert not wrong, f"{level} {dtype_name}: ops with no CPU kernel that the CPU overlay lets run low: {wrong}"


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_the_cpu_overlay_keeps_fp32_only_ops_that_have_no_kernel(dtype_name):
    """The overlay is no blanket: each op it keeps fp32 in a dtype fails there (otherwise it costs speed)."""
    for op, (dtypes, _reason) in DEVICE_OVERLAYS["cpu"].items():
        if dtype_name in dtypes:
            assert any(_missing_kernel(call, dtype_name) for call in SAMPLES[op]), \
                f"{op} runs in {dtype_name} on CPU: the CPU overlay need not keep it fp32"


def test_the_cpu_overlay_applies_only_on_cpu_and_wins_over_the_level():
    from amp_compiler.config import make_config
    for level in ("O1", "O2", "O3"):
        config = make_config(level, dtype=torch.bfloat16)
        assert config.precision_rules().classify("avg_pool3d")[0] != "deny"
        config.devices = ("cpu",)
        klass, _family, reason = config.precision_rules().classify("avg_pool3d")
        assert klass == "deny" and "cpu" in reason, (level, reason)
    config = make_config("O1", dtype=torch.bfloat16, infer_ops=["avg_pool3d"])
    config.devices = ("cpu",)
    assert config.precision_rules().classify("avg_pool3d")[0] == "infer", "the user's own op list wins"


class Pool3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(F.avg_pool3d(self.conv(x), 2).mean(dim=(2, 3, 4)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_cpu_model_keeps_avg_pool3d_fp32_and_runs(dtype):
    torch.manual_seed(0)
    model, x = Pool3d().eval(), torch.randn(1, 3, 4, 8, 8)
    gm = amp_compiler.convert(model, "O1", dtype=dtype, example_inputs=(x,))
    with torch.no_grad():
        out = gm(x)
    assert torch.allclose(out, model(x), atol=5e-2)
    assert gm.meta["amp"]["devices"] == {"devices": ["cpu"], "from": "the model's parameters"}
    rows = [row for row in amp_compiler.explain(gm).rows if row["op"] == "avg_pool3d"]
    assert rows and all(row["dtype"] == "float32" and "cpu" in row["rule"] for row in rows)
    assert "device cpu" in str(amp_compiler.explain(gm)).splitlines()[0]


class DistancesAndSpectrum(nn.Module):
    """Distances to learned centres (an RBF layer) and a spectrum (an FNO-style layer) of one projection."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(5 + 9, 4)
        self.centres = nn.Parameter(torch.randn(5, 16))

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.cat([torch.cdist(h, self.centres), torch.fft.rfft(h).abs()], dim=-1))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_levels_that_lower_denied_ops_keep_those_without_a_cpu_kernel_fp32(level):
    """O2 and O3 run denied ops low; the CPU has no low-precision cdist or FFT: they stay fp32, the model runs."""
    torch.manual_seed(0)
    model, x = DistancesAndSpectrum(), torch.randn(4, 8)
    gm = amp_compiler.convert(model, level, dtype=torch.bfloat16, example_inputs=(x,))
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=0.1)
    rows = {row["op"]: row for row in amp_compiler.explain(gm).rows}
    assert rows["cdist"]["dtype"] == rows["rfft"]["dtype"] == "float32" and "cpu" in rows["cdist"]["rule"]


def test_a_model_without_parameters_takes_the_device_of_its_example_inputs():
    gm = amp_compiler.convert(nn.AvgPool3d(2), "O1", dtype=torch.bfloat16, example_inputs=(torch.randn(1, 2, 4, 4, 4),))
    assert gm.meta["amp"]["devices"] == {"devices": ["cpu"], "from": "the example inputs"}


def _s3d_error_ratio() -> tuple[float, float]:
    """(our error, autocast's) against fp32: torchvision S3D, random init, bf16 on CPU."""
    torchvision = import_torchvision()
    torch.manual_seed(0)
    model = torchvision.models.video.s3d(weights=None, num_classes=10).eval()
    # Its last average pool (2x7x7) needs 16x224x224 clips (30 s here): a 1x2x2 window on 8x64x64 clips runs
    # the same avg_pool3d kernel
    model.avgpool = nn.AvgPool3d((1, 2, 2), stride=1)
    x = torch.randn(1, 3, 8, 64, 64, generator=torch.Generator().manual_seed(1))
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    with torch.no_grad():
        reference = model(x)
        ours = gm(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x).float()
    scale = reference.abs().max()
    return float((ours - reference).abs().max() / scale), float((autocast - reference).abs().max() / scale)


@pytest.mark.slow
def test_torchvision_s3d_runs_at_o1_bf16_on_cpu_within_twice_autocasts_error():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours, autocast = _s3d_error_ratio()
    finally:
        torch.set_num_threads(threads)
    assert ours <= max(2 * autocast, 2.0 ** -8), (ours, autocast)   # floor: one bf16 rounding


class Spectrum(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return torch.fft.rfft(self.proj(x)).abs()


def test_a_node_reading_complex_values_is_explained_as_such():
    # abs of an rfft reads complex64: its rule says so, not "integer operands", and no rule calls it a count
    gm = amp_compiler.convert(Spectrum().eval(), "O2", dtype=torch.bfloat16, example_inputs=(torch.randn(4, 16),))
    rules = {row["node"]: row["rule"] for row in amp_compiler.explain(gm).to_dict()["rows"]}
    assert rules["abs_1"].startswith("clear: complex operands only"), rules["abs_1"]
    assert not any(rule.startswith("counts:") for rule in rules.values())
