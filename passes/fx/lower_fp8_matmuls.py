"""lower_fp8_matmuls: at the fp8 level, the matmuls the bf16 O1 painting runs low become float8 matmuls.

    linear(x_bf16, w_bf16, b_bf16)  ->  fp8_linear(x_bf16, w_bf16, b_bf16, margin)     (fp8_runtime.py)
    matmul(a_bf16, b_bf16) / mm     ->  fp8_matmul(a_bf16, b_bf16, margin)   where b is 2-D (K, N)

The fp8 level is O1 in bfloat16 (levels.py) plus this pass, which runs last in FX_PIPELINE: every decision
before it (what runs low, where casts go) is the bf16 O1 one, and this pass only swaps the function a
decided-low matmul calls; its operands stay the bf16 values O1 computes, and fp8_runtime.py quantizes them
(e4m3 forward, e5m2 gradients, per-tensor current scaling, power-of-two scales). Every low matmul-class node
gets a rule that says which: "fp8 (...): <the O1 rule>" when lowered, "<the O1 rule>; fp8: kept bfloat16:
<why>" when not. A matmul stays bf16 when
  - a user pattern names it (fp8_keep=["lm_head", "layers.*.attention"]: node names or module paths, globbed;
    a pattern that names no low matmul is a ValueError, as force_fp32's);
  - it is not linear/matmul/mm called as a function (a hooked nn.Linear stays a module call; bmm, baddbmm,
    einsum, addmm, conv: not lowered yet), or an operand is not bf16, or the second operand is not one 2-D
    matrix (attention's batched q @ k^T: _scaled_mm multiplies one pair of 2-D matrices);
  - K or N is not a multiple of 16 (cuBLASLt's fp8 GEMM refuses them) or not known at conversion;
  - min(K, N) < fp8_min_dim (default 1024): below it the amax reductions and fp8 casts of x, w and the
    gradient (memory-bound passes) cost about what the faster GEMM saves. The default follows torchao's
    float8 guidance for per-tensor scaling on H100 (no gain for such layers); it is not measured here.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from amp_compiler.passes.fx.fp8_runtime import fp8_linear, fp8_matmul
from amp_compiler.passes.fx.runtime import amp_module_call, is_cast
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.fp8 import Fp8Options, size_rule
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.policy.rules import _matches
from amp_compiler.passes.runner import PassResult

LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
MATMUL_TARGETS = (torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, operator.matmul, "matmul", "mm")


def _operands(node: fx.Node) -> tuple | None:
    """(x, w, bias, as_linear) of a linear/matmul/mm call, w in the call's own layout; None for other forms."""
    args, kwargs = node.args, node.kwargs
    if node.op == "call_function" and node.target in LINEAR_TARGETS:
        names = ("input", "weight", "bias")
        values = list(args) + [kwargs.get(name) for name in names[len(args):]]
        if len(values) == 3 and not set(kwargs) - set(names) and values[1] is not None:
            return values[0], values[1], values[2], True
        return None
    callable_form = node.op == "call_function" or (node.op == "call_method" and isinstance(node.target, str))
    if callable_form and node.target in MATMUL_TARGETS and len(args) == 2 and not kwargs:
        return args[0], args[1], None, False
    return None


def _fetch(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _shape(gm: fx.GraphModule, value) -> tuple | None:
    """The shape the tracer recorded for `value`, looking through casts to a parameter; None if unknown."""
    while isinstance(value, fx.Node):
        recorded = value.meta.get("val")
        if isinstance(recorded, torch.Tensor):
            return tuple(recorded.shape)
        if value.op == "get_attr":
            attribute = _fetch(gm, value.target)
            return tuple(attribute.shape) if isinstance(attribute, torch.Tensor) else None
        value = value.args[0] if is_cast(value) else None
    return None


def _static(size) -> int | None:
    return size if isinstance(size, int) else None


def _kept_because(gm: fx.GraphModule, node: fx.Node, options: Fp8Options, low: torch.dtype,
                  matched: set[str]) -> str | None:
    """Why this decided-low matmul-class node stays bf16, or None when it becomes an fp8 matmul."""
    amp = facts(node)
    for pattern in options.keep:
        if _matches(pattern, amp.get("module", ""), node.name):
            matched.add(pattern)
            return f"user rule: fp8_keep {pattern!r}"
    operands = _operands(node)
    if operands is None:
        module_call = node.op == "call_module" or node.target is amp_module_call   # a leaf kept whole (hooks)
        how = "a module call (its hooks run)" if module_call else f"{amp.get('op')} in this call form"
        return f"{how}: only linear, matmul and mm called as functions are lowered to fp8"
    x, w, _, as_linear = operands
    dtypes = [facts(v).get("dtype") if isinstance(v, fx.Node) else None for v in (x, w)]
    if any(d != low for d in dtypes):
        return f"operands are {', '.join(dtype_name(d) for d in dtypes)}, not both {dtype_name(low)}"
    x_shape, w_shape = _shape(gm, x), _shape(gm, w)
    if x_shape is None or w_shape is None:
        return "operand shapes unknown at conversion (no example inputs recorded them)"
    if len(w_shape) != 2 or len(x_shape) < (1 if as_linear else 2):
        return (f"operand shapes {list(x_shape)} x {list(w_shape)}: _scaled_mm multiplies 2-D matrices, the second "
                "must be one matrix (a batched matmul is not lowered yet)")
    k, n = (w_shape[1], w_shape[0]) if as_linear else (w_shape[0], w_shape[1])
    return size_rule(_static(k), _static(n), options)


def lower_fp8_matmuls(gm: fx.GraphModule, options: Fp8Options, low: torch.dtype) -> PassResult:
    """Rewrite the decided-low linear/matmul/mm nodes that qualify into fp8 calls; give every low
    matmul-class node its fp8 rule. Counts: fp8 (lowered), kept (low matmul-class nodes left in `low`)."""
    if options.scaling != "current":   # until the runtime has them: never run another recipe than the one asked
        raise NotImplementedError(f"fp8_scaling={options.scaling!r} is not built yet; 'current' is")
    lowered = kept = 0
    matched: set[str] = set()
    for node in list(gm.graph.nodes):
        amp = facts(node)
        if amp.get("family") != "matmul" or amp.get("precision") != "low":
            continue
        why = _kept_because(gm, node, options, low, matched)
        if why is not None:
            amp["rule"] = f"{amp.get('rule', '')}; fp8: kept {dtype_name(low)}: {why}"
            kept += 1
            continue
        x, w, bias, as_linear = _operands(node)
        node.op, node.kwargs = "call_function", {}
        node.target, node.args = (fp8_linear, (x, w, bias, options.margin)) if as_linear \
            else (fp8_matmul, (x, w, options.margin))
        amp["rule"] = f"fp8 ({options.recipe()}): {amp.get('rule', '')}"
        lowered += 1
    unmatched = [pattern for pattern in options.keep if pattern not in matched]
    if unmatched:   # as force_fp32's: a typo must not leave a matmul in fp8 silently
        raise ValueError(f"fp8_keep pattern(s) {unmatched} matched no low matmul's node name or module path; "
                         "explain(gm) lists both")
    return PassResult(modified=bool(lowered), counts={"fp8": lowered, "kept": kept})
