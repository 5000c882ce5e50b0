"""lower_fp8_matmuls: at the fp8 level, the matmuls the bf16 O1 painting runs low become float8 matmuls, with
the scaling of each operand written out as graph nodes.

    linear(x, w, b)        ->  x_amax = fp8_amax(x, dim)                  for x, then the same for w:
    matmul(a, b) / mm      ->  x_scale = fp8_scale(x_amax, e4m3, margin)      (delayed: fp8_delayed_scale)
    addmm(bias, a, b)      ->  x_fp8 = fp8_cast(x, x_scale, e4m3)
                               out = fp8_scaled_linear(x, w, x_fp8, w_fp8, x_scale, w_scale, b, <gradient recipe>)
                                     (fp8_scaled_matmul for matmul/mm/addmm, whose b is 2-D (K, N))

The fp8 level is O1 in bfloat16 (levels.py) plus this pass, which runs last in FX_PIPELINE: every decision
before it (what runs low, where casts go) is the bf16 O1 one, and this pass only rewrites a decided-low
matmul; its operands stay the bf16 values O1 computes. fp8_runtime.py holds the helpers and the recipes
(fp8_scaling): "current" (per tensor, dim None), "delayed" (per tensor, from an amax history: an Fp8History
module per matmul at gm.fp8_history.<node>, whose buffers state_dict saves) and "rowwise" (dim -1 for x and
a linear's (N, K) weight, dim 0 for a matmul's (K, N) operand; e4m3 gradients). Each scaling node carries facts
(op, dtype, module, precision None: bookkeeping, not a painting decision) and a rule naming the matmul it
scales, so explain() lists it next to that matmul. Every low matmul-class node gets a rule that says which:
"fp8 (...): <the O1 rule>" when lowered, "<the O1 rule>; fp8: kept bfloat16: <why>" when not. A matmul stays
bf16 when
  - a user pattern names it (fp8_keep=["lm_head", "layers.*.attention"]: node names or module paths, globbed;
    a pattern that names no low matmul is a ValueError, as force_fp32's);
  - it is not linear/matmul/mm/addmm called as a function (a hooked nn.Linear stays a module call; bmm,
    baddbmm, einsum, conv: not lowered yet; addmm with beta or alpha), or an operand is not bf16, or the second
    operand is not one 2-D matrix (attention's batched q @ k^T: _scaled_mm multiplies one pair of 2-D matrices);
  - K or N is not a multiple of 16 (cuBLASLt's fp8 GEMM refuses them) or not known at conversion;
  - min(K, N) < fp8_min_dim (default 1024): below it the amax reductions and fp8 casts of x, w and the
    gradient (memory-bound passes) cost about what the faster GEMM saves. The default follows torchao's
    float8 guidance for per-tensor scaling on H100 (no gain for such layers); it is not measured here;
  - with calibration_data, its operands' e4m3 round-trip error on the samples (facts "fp8_calibration",
    written by measure_fp8_operands; per tensor, or per row at fp8_scaling="rowwise") exceeds fp8_max_error.
    A lowered node's rule then quotes its figures, and at "delayed" its x and w histories start from the
    calibrated amax.

For export_onnx (Fp8Options.form "export_marker", passes/policy/fp8.py) the decision is the same and made here
once; a lowered matmul becomes one call of its export marker instead (fp8_runtime.fp8_export_markers), on the
same operands, with the calibrated max |x| (NO_AMAX: none), and no scaling nodes:
    linear(x, w, b)  ->  amp_compiler_fp8_onnx.linear(x, w, b, x_amax)
    matmul/mm(a, b), addmm(bias, a, b)  ->  amp_compiler_fp8_onnx.matmul(a, b, bias, x_amax)
torch.onnx writes each as a MatMul tagged with the marker, and the ONNX lower_fp8_matmuls gives exactly those
nodes their float8 operands (its scaling written as ONNX nodes).
"""
from __future__ import annotations

import operator
from functools import reduce

import torch
import torch.fx as fx
import torch.nn.functional as F

from amp_compiler.passes.fx.fp8_runtime import (E4M3, E5M2, FP8_MAX, HISTORIES, Fp8History, fp8_amax, fp8_cast,
                                                fp8_delayed_scale, fp8_export_markers, fp8_scale, fp8_scaled_linear,
                                                fp8_scaled_matmul)
from amp_compiler.passes.fx.runtime import amp_module_call, is_cast
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.fp8 import FP8_FORMS, NO_AMAX, Fp8Options, size_rule
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.policy.rules import pattern_matches
from amp_compiler.passes.runner import PassResult

aten = torch.ops.aten
# The torch function forms (fx symbolic trace) and the ATen overloads (a torch.export capture: Hugging Face models
# called with labels, for one): a matmul missing here stays bf16 with "in this call form" as its rule
LINEAR_TARGETS = (F.linear, torch._C._nn.linear, aten.linear.default)
MATMUL_TARGETS = (torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, operator.matmul, "matmul", "mm",
                  aten.matmul.default, aten.mm.default)
ADDMM_TARGETS = (torch.addmm, torch.Tensor.addmm, "addmm", aten.addmm.default)
HISTORY_ROOT = "fp8_history"   # gm.fp8_history.<matmul node>: its Fp8History (delayed scaling)
DDP_IGNORED = "_ddp_params_and_buffers_to_ignore"   # names DistributedDataParallel neither broadcasts nor reduces


def matmul_operands(node: fx.Node) -> tuple | None:
    """(x, w, bias, as_linear) of a linear/matmul/mm/addmm call in a form this pass lowers, w in the call's own
    layout ((N, K) for a linear, as_linear True; (K, N) otherwise), bias None where the call has none; None for
    other forms (a module call, bmm, addmm with beta or alpha, ...). measure_fp8_operands measures these."""
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
    # addmm(bias, a, b) = bias + a @ b; beta/alpha other than 1 would need their own scaling: not lowered
    if callable_form and node.target in ADDMM_TARGETS and len(args) == 3 and \
            all(kwargs.get(name, 1) == 1 for name in kwargs) and not set(kwargs) - {"beta", "alpha"}:
        return args[1], args[2], args[0], False
    return None


def _shape(gm: fx.GraphModule, value) -> tuple | None:
    """The shape the tracer recorded for `value`, looking through casts to a parameter; None if unknown."""
    while isinstance(value, fx.Node):
        recorded = value.meta.get("val")
        if isinstance(recorded, torch.Tensor):
            return tuple(recorded.shape)
        if value.op == "get_attr":
            attribute = reduce(getattr, value.target.split("."), gm)   # as constant_range.py
            return tuple(attribute.shape) if isinstance(attribute, torch.Tensor) else None
        value = value.args[0] if is_cast(value) else None
    return None


def _static(size) -> int | None:
    return size if isinstance(size, int) else None


def _calibrated_error(calibration: dict, options: Fp8Options) -> tuple[float, float, str]:
    """(x error, w error, granularity) the recipe's quantization has on the calibration samples."""
    if options.scaling == "rowwise":
        return calibration["x_error_rowwise"], calibration["w_error_rowwise"], "per row"
    return calibration["x_error"], calibration["w_error"], "per tensor"


def _calibration_words(calibration: dict, options: Fp8Options) -> str:
    x_error, w_error, granularity = _calibrated_error(calibration, options)
    return (f"calibrated e4m3 error x {x_error:.3g}, w {w_error:.3g} ({granularity}, "
            f"{calibration.get('samples', '?')} samples)")


def _kept_because(gm: fx.GraphModule, node: fx.Node, options: Fp8Options, low: torch.dtype,
                  matched: set[str]) -> str | None:
    """Why this decided-low matmul-class node stays bf16, or None when it becomes an fp8 matmul."""
    amp = facts(node)
    for pattern in options.keep:
        if pattern_matches(pattern, amp.get("module", ""), node.name):
            matched.add(pattern)
            return f"user rule: fp8_keep {pattern!r}"
    operands = matmul_operands(node)
    if operands is None:
        module_call = node.op == "call_module" or node.target is amp_module_call   # a leaf kept whole (hooks)
        if node.target in ADDMM_TARGETS and {"beta", "alpha"} & set(node.kwargs):
            scaled = ", ".join(f"{name}={node.kwargs[name]!r}" for name in ("beta", "alpha") if name in node.kwargs)
            return f"addmm with {scaled}: only beta = alpha = 1 is lowered to fp8"
        how = "a module call (its hooks run)" if module_call else f"{amp.get('op')} in this call form"
        return f"{how}: only linear, matmul, mm and addmm called as functions are lowered to fp8"
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
    sized = size_rule(_static(k), _static(n), options)
    calibration = amp.get("fp8_calibration")
    if sized is None and calibration is not None and max(_calibrated_error(calibration, options)[:2]) > \
            options.max_error:
        return f"{_calibration_words(calibration, options)} > fp8_max_error {options.max_error:g}"
    return sized


def _add_history(gm: fx.GraphModule, node: fx.Node, options: Fp8Options) -> fx.Node:
    """An Fp8History for `node` on gm (calibrated amax as its first entry) and the get_attr node reading it."""
    calibration = facts(node).get("fp8_calibration") or {}
    start = {name: amax for name in ("x_amax", "w_amax")
             if isinstance(amax := calibration.get(name), (int, float)) and 0 < amax < float("inf")}
    device = next((p.device for p in gm.parameters()), None)
    target = f"{HISTORY_ROOT}.{node.name}"
    history = Fp8History(options.history, start.get("x_amax", 0.0), start.get("w_amax", 0.0), device=device)
    gm.add_submodule(target, history.train(gm.training))   # added after the graph took its flag: recording follows it
    # DistributedDataParallel broadcasts rank 0's buffers before each forward: every rank would scale from rank 0's
    # amaxes (saturating where its own are larger). Each rank keeps its own history (its own data's amax).
    ignored = getattr(gm, DDP_IGNORED, [])
    setattr(gm, DDP_IGNORED, [*ignored, *(f"{target}.{name}" for name in HISTORIES)])
    return gm.graph.get_attr(target)


def _scaling_nodes(graph: fx.Graph, node: fx.Node, operand: fx.Node, which: str, dim: int | None,
                   options: Fp8Options, histories: fx.Node | None) -> tuple[fx.Node, fx.Node]:
    """amax, scale and cast nodes of one operand (`which`: "x" or "w") of `node`; returns (cast, scale)."""
    module = facts(node).get("module", "")
    per = "per tensor" if dim is None else "per row" if dim == -1 else "per column"
    limit = f"{FP8_MAX[E4M3]:g} (e4m3)"

    def add(target, args, suffix: str, dtype: torch.dtype, rule: str) -> fx.Node:
        added = graph.create_node("call_function", target, args, name=f"{node.name}_{which}_{suffix}")
        op = "fp8_scale" if target is fp8_delayed_scale else target.__name__   # one op name per scaling step
        added.meta["amp"] = {"op": op, "module": module, "precision": None, "dtype": dtype,
                             "rule": f"fp8 scaling of {node.name}'s {which}: {rule}"}
        return added

    amax = add(fp8_amax, (operand, dim), "amax", torch.float32, f"max |{which}| {per}, float32")
    if histories is None:
        scale = add(fp8_scale, (amax, E4M3, options.margin), "scale", torch.float32,
                    f"largest power of two s with amax * s <= {limit}, / 2**{options.margin}")
    else:
        scale = add(fp8_delayed_scale, (amax, histories, which, E4M3, options.margin, options.amax_from), "scale",
                    torch.float32, f"power of two from the {options.amax_from} of {HISTORY_ROOT}.{node.name}.{which} "
                    f"({options.history} calls' amax; this call's while empty; recorded in training mode) "
                    f"<= {limit}, / 2**{options.margin}")
    cast = add(fp8_cast, (operand, scale, E4M3), "fp8", E4M3, f"{which} * scale as float8_e4m3fn, saturating at "
               f"+-{FP8_MAX[E4M3]:g}")
    return cast, scale


def _lower(gm: fx.GraphModule, node: fx.Node, options: Fp8Options) -> None:
    """Rewrite `node` into its scaling nodes and one fp8_scaled_linear/_matmul node (module docstring)."""
    x, w, bias, as_linear = matmul_operands(node)
    rowwise = options.scaling == "rowwise"
    with gm.graph.inserting_before(node):
        histories = _add_history(gm, node, options) if options.scaling == "delayed" else None
        x_fp8, x_scale = _scaling_nodes(gm.graph, node, x, "x", -1 if rowwise else None, options, histories)
        w_dim = (-1 if as_linear else 0) if rowwise else None   # a (N, K) weight's rows, a (K, N) one's columns
        w_fp8, w_scale = _scaling_nodes(gm.graph, node, w, "w", w_dim, options, histories)
    grad_dtype = E4M3 if rowwise else E5M2   # fp8_runtime.py: the row-wise kernel multiplies e4m3 by e4m3
    node.op, node.kwargs = "call_function", {}
    node.target = fp8_scaled_linear if as_linear else fp8_scaled_matmul
    node.args = (x, w, x_fp8, w_fp8, x_scale, w_scale, bias, grad_dtype, options.margin, rowwise, histories,
                 options.amax_from)


def _mark_for_export(node: fx.Node) -> None:
    """Rewrite `node` into the call of its export marker (module docstring): the same operands, no scaling."""
    x, w, bias, as_linear = matmul_operands(node)
    calibration = facts(node).get("fp8_calibration") or {}
    node.op, node.kwargs = "call_function", {}
    linear_marker, matmul_marker = fp8_export_markers()
    node.target = linear_marker if as_linear else matmul_marker
    node.args = (x, w, bias, float(calibration.get("x_amax", NO_AMAX)))


def lower_fp8_matmuls(gm: fx.GraphModule, options: Fp8Options, low: torch.dtype) -> PassResult:
    """Rewrite the decided-low linear/matmul/mm/addmm nodes that qualify into fp8 scaling nodes and an fp8
    matmul (options.form "export_marker": into their export markers); give every low matmul-class node its fp8
    rule. Counts: fp8 (lowered), kept (low matmul-class nodes left in `low`)."""
    if options.form not in FP8_FORMS:
        raise ValueError(f"Fp8Options.form must be one of {', '.join(map(repr, FP8_FORMS))}; got {options.form!r}")
    lower = _mark_for_export if options.form == "export_marker" else lambda node: _lower(gm, node, options)
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
        lower(node)
        calibration = amp.get("fp8_calibration")
        measured = f"; {_calibration_words(calibration, options)} <= {options.max_error:g}" if calibration else ""
        amp["rule"] = f"fp8 ({options.recipe()}{measured}): {amp.get('rule', '')}"
        lowered += 1
    unmatched = [pattern for pattern in options.keep if pattern not in matched]
    if unmatched:   # as force_fp32's: a typo must not leave a matmul in fp8 silently
        raise ValueError(f"fp8_keep pattern(s) {unmatched} matched no low matmul's node name or module path; "
                         "explain(gm) lists both")
    return PassResult(modified=bool(lowered), counts={"fp8": lowered, "kept": kept})
