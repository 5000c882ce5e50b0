"""Spellings that mean the same op: each maps to the canonical name op_policy.py keys its table by.

    ALIASES["truediv"] == "div"        ALIASES["native_layer_norm"] == "layer_norm"

IR-neutral: the fx canonicalizer (passes/fx/canonicalize.py) names nodes through it, the rules
(passes/policy/rules.py) read a user's op lists through it ("truediv" in deny_ops acts on the nodes named
"div"), and the ONNX export passes name the ATen op a node came from through it (passes/onnx/torch_origin.py).
"""
from __future__ import annotations

ALIASES = {
    "truediv": "div", "divide": "div", "multiply": "mul", "subtract": "sub", "iadd": "add", "imul": "mul",
    "isub": "sub", "itruediv": "div", "radd": "add", "rmul": "mul", "matrix_multiply": "matmul",
    "native_layer_norm": "layer_norm", "native_batch_norm": "batch_norm",
    "native_batch_norm_legit": "batch_norm", "native_batch_norm_legit_functional": "batch_norm",
    "native_batch_norm_legit_no_training": "batch_norm", "native_group_norm": "group_norm",
    "log_softmax_backward_data": "log_softmax", "safe_softmax": "softmax", "native_dropout": "dropout",
    "unsafe_view": "view", "to_copy": "to", "sym_size_int": "sym_size", "concat": "cat",
    "upsample_nearest2d_vec": "upsample_nearest2d", "upsample_bilinear2d_vec": "upsample_bilinear2d",
    "pos": "identity", "contiguous_format": "contiguous",
    "scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "mean_dim": "mean",
    "copy": "clone", "lift_fresh_copy": "clone", "expand_copy": "expand", "view_copy": "view",
    "permute_copy": "permute", "transpose_copy": "transpose", "slice_copy": "slice",
    "select_copy": "select", "squeeze_copy": "squeeze", "unsqueeze_copy": "unsqueeze",
    "t_copy": "t", "split_with_sizes": "split", "new_zeros": "zeros_like", "new_ones": "ones_like",
    "new_full": "full_like", "new_empty": "empty_like", "fill": "full_like",
    "amp_opaque_call": "opaque_call",
    "inv": "inverse", "inv_ex": "inverse", "pinv": "pinverse", "cholesky_ex": "cholesky", "solve_ex": "solve",
    # operator.and_ / aten.__and__ (masks combined with &): the trailing underscore is Python's, not in-place
    "and": "and_", "or": "or_", "not": "not_", "iand": "and_", "ior": "or_", "ixor": "xor",
}


def canonical_op_name(name: str) -> str:
    """The name op_policy keys an op by, from how torch spells it: aten.__and__ -> "and_", add_ (in place) -> "add",
    _softmax -> "softmax", fft_rfft -> "rfft". Both IRs name ops through it (fx nodes, and the ATen op an
    exported ONNX node came from)."""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:   # operator dunders: aten.__and__
        name = name[2:-2]
    name = name.lstrip("_")
    if name.endswith("_") and not name.endswith("__"):  # in-place spelling: add_ -> add
        name = name[:-1]
    for namespace in ("fft_", "linalg_"):   # torch.fft.rfft is "fft_rfft", torch.linalg.inv "linalg_inv"
        if name.startswith(namespace) and len(name) > len(namespace):
            name = name[len(namespace):]
    return ALIASES.get(name, name)
