"""What generated code calls: every helper a converted GraphModule's forward names, in one module.

    amp_cast(x, torch.float16)                           a cast node (insert_casts)
    amp_module_call(self.gru, torch.float16, x)          a low leaf with its parameters cast for one call
    amp_opaque_call(self.block, (torch.bfloat16, torch.float32), x)   code fx cannot see into (opaque_calls)
    dropout_p_when_training(p, self.training_flag())     a train flag torch.export baked in (export_capture)
    amp_frozen_cast(w, torch.bfloat16, copies)           a weight's cached low copy (freeze_weight_casts)
    amp_frozen_module_call(self.gru, torch.float16, copies, x)   a low leaf reading cached parameter copies
    mask_for_fused_attention(mask)                      an sdpa mask laid out for GPU kernels (fused_attention_masks)

Each is a `graph_leaf`: torch.load re-creates a GraphModule by tracing its generated code again;
torch.fx.wrap only covers calls by the wrapped name inside the module that wrapped it, so without this
the re-trace would run the function's body on proxies (amp_cast would silently become a no-op).
Saved files name these by module path: moving one breaks files saved before the move (no old name is kept).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx as fx
from torch import nn

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_float(dtype) -> bool:
    """Castable by AMP: fp32/fp16/bf16. fp64, integers and bools are never cast."""
    return dtype in FLOAT_DTYPES


_MAY_HOLD_A_PROXY = (fx.Proxy, tuple, list, dict)


def graph_leaf(fn):
    @functools.wraps(fn)
    def leaf(*args, **kwargs):
        # Fast path first: these run once per cast per call, and a converted model's calls are what a GPU
        # waits on when its kernels are small (the full walk cost about 2.5 us per cast on this CPU).
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, _MAY_HOLD_A_PROXY):
                break
        else:
            return fn(*args, **kwargs)
        proxies: list = []
        fx.node.map_aggregate((args, kwargs), lambda v: proxies.append(v) if isinstance(v, fx.Proxy) else None)
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", leaf, args, kwargs)
        return fn(*args, **kwargs)
    return leaf


@graph_leaf
def amp_cast(value, dtype: torch.dtype, contiguous: bool = False):
    """Cast fp32/fp16/bf16 tensors (also inside tuples, lists, dicts) to `dtype`; the rest passes through.
    `contiguous`: write the copy in row-major order (a transposed input costs low-precision matmuls dearly)."""
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype and value.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return value.to(dtype, memory_format=torch.contiguous_format if contiguous else torch.preserve_format)
        return value
    if isinstance(value, (tuple, list, dict)):
        return torch.utils._pytree.tree_map(lambda leaf: amp_cast(leaf, dtype, contiguous), value)
    return value


def is_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is amp_cast


def _call_with_low_params(module: nn.Module, low, args, kwargs):
    """Run `module` with each fp32/fp16/bf16 parameter replaced by low(parameter) for this call only."""
    params = {name: low(p) if p.is_floating_point() and p.dtype != torch.float64 else p
              for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, args, kwargs)


@graph_leaf
def amp_module_call(module: nn.Module, dtype: torch.dtype, *args, **kwargs):
    """Run `module` with its floating parameters cast to `dtype` for this call only."""
    return _call_with_low_params(module, lambda p: p.to(dtype), args, kwargs)


def _device_type(values) -> str:
    for leaf in torch.utils._pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


@graph_leaf
def amp_opaque_call(callee, policy: tuple, *args, **kwargs):
    """Call `callee` (a module, a function or an autograd Function's apply) under `policy`:
    (autocast dtype or None, dtype of the float outputs or None)."""
    autocast_dtype, output_dtype = policy
    scope = torch.autocast(_device_type((args, kwargs)), dtype=autocast_dtype) if autocast_dtype \
        else contextlib.nullcontext()
    with scope:
        out = callee(*args, **kwargs)
    if output_dtype is None:
        return out
    cast = lambda v: v.to(output_dtype) if isinstance(v, torch.Tensor) and is_float(v.dtype) \
        and v.dtype != output_dtype else v  # noqa: E731
    if dataclasses.is_dataclass(out) and not isinstance(out, type) and torch.utils._pytree._is_leaf(out):
        # a plain dataclass (an encoder's EncoderOutput) is a pytree leaf: its fields would stay low
        return dataclasses.replace(out, **{f.name: torch.utils._pytree.tree_map(cast, getattr(out, f.name))
                                           for f in dataclasses.fields(out) if f.init})
    return torch.utils._pytree.tree_map(cast, out)


def strided_last_dim(tensor: torch.Tensor) -> bool:
    """Whether the last dim has a stride other than 1 and more than one element (a symbolic size counts as
    more): the layout torch's fused GPU attention kernels refuse for a mask. Works on fake values too."""
    if not tensor.dim():
        return False
    size = tensor.shape[-1]
    return bool(tensor.stride(-1) != 1) and not (isinstance(size, int) and size <= 1)


@graph_leaf
def mask_for_fused_attention(mask):
    """An attention mask whose last dim has stride 0 (expanded), made dense on a GPU: torch's fused GPU
    attention kernels refuse such a mask and fall back to the math kernel, which computes fp16 attention in
    fp32 (HF BERT on an H200: fp32 bmm, 1.3-1.4x autocast's time). The CPU kernels take any stride: no copy."""
    if isinstance(mask, torch.Tensor) and mask.device.type != "cpu" and strided_last_dim(mask):
        return mask.contiguous()
    return mask


@graph_leaf
def dropout_p_when_training(p: float, training: bool) -> float:
    return p if training else 0.0


@graph_leaf
def amp_frozen_check(copies):
    """Once per call, before any frozen cast: drop the copies whose weights changed (amp_compiler/frozen.py:
    FrozenWeights.check compares every weight's sampled values in one operation, so one device sync per call,
    not one per weight). Returns `copies` for the casts to read, which orders them after the check."""
    copies.check()
    return copies


@graph_leaf
def amp_frozen_module_call(module: nn.Module, dtype: torch.dtype, copies, *args, **kwargs):
    """amp_module_call with each floating parameter read from `copies` (FrozenWeights): cast once, not per call."""
    return _call_with_low_params(module, lambda p: copies.read(p, dtype), args, kwargs)


@graph_leaf
def amp_frozen_cast(weight, dtype: torch.dtype, copies):
    """`weight` in `dtype` from `copies` (amp_compiler/frozen.py: FrozenWeights), which makes the copy once
    and again only when the weight changed; while training or when autograd needs the weight, a plain cast.
    The weight comes first, as in amp_cast: tools that replay a cast as its input (compare) need no change."""
    return copies.read(weight, dtype)
