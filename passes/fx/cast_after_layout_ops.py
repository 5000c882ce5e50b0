"""Cast after a transpose, not before it: the cast's copy then writes the matmul-friendly layout.

    t = transpose(amp_cast(x, bf16), 0, 1); linear(t, w)   ->   t = transpose(x, 0, 1)           (a view)
                                                                linear(amp_cast(t, bf16, contiguous=True), w)
A transposed low-precision activation makes CPU matmul kernels take a strided path (a bf16 linear on a
transposed (197, 2, 768) input: 1.1 s, against 7 ms when the same input is contiguous). The cast copies
the tensor anyway, so writing the copy row-major costs nothing. Views of fp32 values are free, so the
layout op moves to the fp32 side. Runs after fold_casts; new casts carry meta["amp_role"] = "cast".
A transpose already on the low side (a padded, reshaped, transposed window in timm's Twins) gets an
explicit row-major copy before the matmul reading it, when its value is known to have 3 or more dims.
A permute that only turns a channels-last value back into NCHW order (ConvNeXt's and ViTamin's LayerNorm2d:
permute(0, 2, 3, 1), layer_norm, permute(0, 3, 1, 2)) stays after its cast unless a matmul reads it: the
cast then copies straight and keeps the channels-last layout convolutions run natively, where a row-major
copy is a transposing copy and the next convolution gets NCHW (convnext_atto 1.40x -> 1.03x autocast).
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.fx.runtime import is_cast
from amp_compiler.passes.policy.numerics import LAYOUT_OPS, MATMUL_OPS, dtype_name
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts


def cast_after_layout_ops(gm: fx.GraphModule) -> PassResult:
    graph, moved = gm.graph, 0
    for cast in [n for n in graph.nodes if is_cast(n)]:
        source, dtype = cast.args
        for view in [u for u in cast.users if facts(u).get("op") in LAYOUT_OPS and not _channels_last_view(u)
                     and u.args and u.args[0] is cast and u.op in ("call_function", "call_method")]:
            with graph.inserting_before(view):
                fp32_view = graph.node_copy(view, lambda n: source if n is cast else n)
                fp32_view.meta = {**view.meta, "amp": {
                    **facts(view), "dtype": facts(source)["dtype"], "precision": None,
                    "rule": "layout op moved before its cast: the cast writes the transposed value row-major"}}
                new_cast = graph.call_function(cast.target, (fp32_view, dtype), {"contiguous": True})
            new_cast.meta = {**cast.meta, "amp": {**facts(cast), "rule": f"boundary: {fp32_view.name} "
                             f"read as {dtype_name(dtype)}, written contiguous"}}
            new_cast.meta["amp_role"] = "cast"
            view.replace_all_uses_with(new_cast)
            graph.erase_node(view)
            moved += 1
        if not cast.users:
            graph.erase_node(cast)
    copies = make_matmul_inputs_contiguous(gm)
    return PassResult(modified=moved + copies > 0,
                      counts={"casts_moved_after_layout_ops": moved, "contiguous_copies": copies})


def _channels_last_view(view: fx.Node) -> bool:
    """A permute that moves the last of 4 or 5 dims to dim 1 (NHWC -> NCHW: of a contiguous value, a
    channels-last view), read by no matmul."""
    rest = view.args[1:]
    dims = view.kwargs.get("dims", rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest)
    if facts(view).get("op") != "permute" or len(dims) not in (4, 5) or not all(isinstance(d, int) for d in dims):
        return False
    rank = len(dims)
    return (tuple(d % rank for d in dims) == (0, rank - 1, *range(1, rank - 1))
            and not any(facts(user).get("op") in MATMUL_OPS for user in view.users))


def _batched_low_layout_input(node: fx.Node) -> fx.Node | None:
    """The transposed, low-precision, 3+-dim first input of a low matmul, else None."""
    amp = facts(node)
    if amp.get("op") not in MATMUL_OPS or amp.get("precision") != "low" or not node.args:
        return None
    value = node.args[0]
    if not isinstance(value, fx.Node) or facts(value).get("op") not in LAYOUT_OPS:
        return None
    fake = value.meta.get("val")
    return value if getattr(fake, "dim", lambda: 0)() >= 3 else None


def make_matmul_inputs_contiguous(gm: fx.GraphModule) -> int:
    graph, copies = gm.graph, 0
    for node in list(graph.nodes):
        value = _batched_low_layout_input(node)
        if value is None:
            continue
        with graph.inserting_before(node):
            copy = graph.call_method("contiguous", (value,))
        copy.meta = {"val": value.meta.get("val"), "amp": {
            **facts(value), "op": "contiguous",
            "rule": "row-major copy: a transposed low-precision input sends matmul kernels down a strided path"}}
        node.replace_input_with(value, copy)
        copies += 1
    return copies
