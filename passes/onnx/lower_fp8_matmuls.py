"""lower_fp8_matmuls (ONNX): at the fp8 level, the low MatMul/Gemm nodes that qualify read float8 operands.

    y = MatMul(x_f16, W_f16)   ->   x8 = QuantizeLinear(x_f16, sx, output_dtype=FLOAT8E4M3FN)   sx: below
                                    xq = DequantizeLinear(x8, sx)
                                    wq = DequantizeLinear(W8, sw)                  W8: a FLOAT8E4M3FN initializer
                                    y  = MatMul(xq, wq)                            (Gemm: its A and B inputs)

The ONNX twin of passes/fx/lower_fp8_matmuls.py, with the same options and size rule (passes/policy/fp8.py),
so a matmul that runs fp8 in torch is the one written fp8 in the file. What decides:
  - export_onnx: convert() decided, once (the fx pass, at Fp8Options.form "export_marker"), and wrote each of
    its fp8 matmuls as a marker op (fp8_runtime.fp8_export_markers()), which the exporter writes as a
    MatMul whose origin names the marker: those MatMul nodes are lowered, every other one keeps its dtype; the
    report's rows are explain()'s;
  - convert_onnx: a MatMul/Gemm painted low stays float16/bfloat16 (its rule says why) when fp8_keep names it
    (node name or torch module path), when its B is not one 2-D matrix of known size, when Gemm transposes A,
    or when size_rule refuses K, N (multiples of 16, min(K, N) >= fp8_min_dim).
Weights (a 2-D initializer, read directly or through Casts and Transposes) are stored as FLOAT8E4M3FN with
one power-of-two scale each (policy/fp8.py's power_of_two_scale at fp8_margin: fp8_runtime.current_scale's, without
torch; this pass imports neither torch nor the fx passes): half the bytes of fp16. Activations get a QuantizeLinear/
DequantizeLinear pair (TensorRT fuses Q/DQ around a MatMul into an fp8 GEMM), whose scale is computed by
explicit nodes on each run (current scaling):
    amax = ReduceMax(Abs(x)); sx = 2 ** ceil(log2(amax / 448)) * 2 ** margin   (fp32, exact powers of two)
or, where calibration measured x, a static initializer (the same formula on the measured amax):
convert_onnx(calibration_data=...) records max |x| over the samples at the node that produced x (a graph
input is not measured); export_onnx(calibration_data=...) passes convert()'s measure of each fp8 matmul's x
(facts "fp8_calibration") through its marker op. A measured amax of 0 (x was all zeros on every sample: a
branch the samples never reached) says nothing of x's range, so its scale is computed (as fx's delayed history
reads an entry of 0 as nothing recorded): a static scale from it, the smallest, saturated every later nonzero x
to ~3e-5 (output 1.00 relative error). A calibrated amax the run exceeds saturates as calibration means it to.
sx is the dequantizing scale, 1 / fx's quantizing one; an inf or NaN amax gives an inf/NaN scale, so the
product is NaN, as fx's scale 0 makes it. QuantizeLinear to a float8 type saturates by default
(saturate=1: a value past 448 * sx becomes +-448, not NaN): the same saturating cast as fp8_runtime.py.
A value read by several lowered matmuls (q, k, v projections) is quantized once. Needs opset >= 21
(FP8_OPSET says why): fp8_opset raises a model's opset with the version converter.
"""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import onnx_ir as ir

from amp_compiler.passes.onnx.canonicalize import all_nodes
from amp_compiler.passes.onnx.cast_nodes import UniqueNames, is_cast
from amp_compiler.passes.onnx.spec import is_float_value
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.fp8 import (E4M3, FP8_EXPORT_NAMESPACE, FP8_FORMATS, NO_AMAX, Fp8Options,
                                            power_of_two_scale, size_rule)
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.policy.rules import pattern_matches
from amp_compiler.passes.runner import PassResult

# Float8 types and Q/DQ to them exist since opset 19, where QuantizeLinear's output type is its zero point's;
# opset 21 names it by an attribute (output_dtype), which this pass uses: onnxruntime 1.31's QDQ propagation
# (graph optimization level basic and up) copies a QuantizeLinear past the Reshape its MatMulAddFusion inserts
# without the zero point, so with a static scale a float8 Q became a uint8 one and the output was silently
# wrong (0.71 relative error on tests/fp8/test_onnx_fp8.py's model; with output_dtype it is fp8's 0.06).
FP8_OPSET = 21
_MARKER_CALL = re.compile(r"args = \((.*)\), kwargs = ")
E4M3_MAX = FP8_FORMATS[E4M3]   # 448
_E4M3_NUMPY = np.dtype(getattr(ml_dtypes, E4M3))   # float8_e4m3fn: round to nearest even, as torch's cast
SMALLEST_SCALE = 2.0 ** -24   # the smallest fp16 value: a scale in the activation's dtype must not flush to 0
_FLOAT = ir.DataType.FLOAT


def fp8_opset(model: ir.Model) -> int:
    """Raise the model's default-domain opset to FP8_OPSET when it is lower; returns the opset it had."""
    had = model.opset_imports.get("", 1)
    if had < FP8_OPSET:
        from onnxscript.version_converter import convert_version   # only fp8 needs it
        convert_version(model, FP8_OPSET, fallback=True)
        model.opset_imports[""] = max(model.opset_imports.get("", 1), FP8_OPSET)
    return had


def onnx_recipe(options: Fp8Options, low: ir.DataType) -> str:
    """The recipe in words, as the rules of the ONNX fp8 matmuls show it."""
    return (f"e4m3 QuantizeLinear/DequantizeLinear around the matmul, weight stored FLOAT8E4M3FN, out "
            f"{dtype_name(low)}; per-tensor scales, powers of two, margin {options.margin}")


def is_export_marker(node: ir.Node) -> bool:
    """Written by the exporter for one of export_onnx's fp8 marker ops (a matmul convert() ran in fp8)."""
    return f"torch.ops.{FP8_EXPORT_NAMESPACE}." in node.metadata_props.get("pkg.torch.onnx.fx_node", "")


def marker_amax(node: ir.Node) -> float | None:
    """The calibrated max |x| an export marker carries as its last argument (the exporter's record of the call,
    "args = (%x, %w, %b, 3.46875), kwargs = {}"); None when it carries NO_AMAX or cannot be read."""
    match = _MARKER_CALL.search(node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
    try:
        amax = float(match.group(1).rsplit(",", 1)[-1]) if match else NO_AMAX
    except ValueError:
        return None
    return amax if amax > 0 and math.isfinite(amax) else None   # 0: no range was seen (module docstring)


def _matrix(value: ir.Value | None) -> tuple[int, int] | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        return None
    return int(shape[0]), int(shape[1])


def _kept_because(node: ir.Node, options: Fp8Options, low: ir.DataType, matched: set[str]) -> str | None:
    """Why this low MatMul/Gemm stays in `low` (convert_onnx), or None when it qualifies."""
    amp = facts(node)
    for pattern in options.keep:
        if pattern_matches(pattern, amp.get("module", ""), node.name):
            matched.add(pattern)
            return f"user rule: fp8_keep {pattern!r}"
    a, b = node.inputs[0], node.inputs[1]
    dtypes = [v.dtype if is_float_value(v) else None for v in (a, b)]
    if any(d != low for d in dtypes):
        return f"operands are {', '.join(str(d) for d in dtypes)}, not both {dtype_name(low)}"
    matrix = _matrix(b)
    if matrix is None or a.shape is None or len(a.shape) < 1:
        return "B is not one 2-D matrix of known size (a batched or dynamic matmul is not lowered)"
    attrs = node.attributes
    if node.op_type == "Gemm" and attrs.get_int("transA", 0):
        return "Gemm with transA=1 (its A is read transposed)"
    k, n = matrix[::-1] if node.op_type == "Gemm" and attrs.get_int("transB", 0) else matrix
    return size_rule(k, n, options)


class _Fp8Rewrite:
    """Builds the Q/DQ nodes in one model: one quantized copy per activation value, one per weight."""

    def __init__(self, model: ir.Model, options: Fp8Options, low: ir.DataType):
        self.model, self.options, self.low = model, options, low
        self.names = UniqueNames(model)
        self.quantized: dict[tuple[ir.Value, ir.Graph], ir.Value] = {}
        self.stored: dict[tuple, ir.Value] = {}   # one float8 copy per weight and layout, however many readers
        self.constants: dict[str, ir.Value] = {}
        self.static = self.computed = self.weights = 0

    def _initializer(self, base: str, array: np.ndarray, graph: ir.Graph) -> ir.Value:
        name = self.names.value(base)
        value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
        value.type, value.shape = ir.TensorType(value.const_value.dtype), ir.Shape(array.shape)
        graph.register_initializer(value)
        return value

    def _node(self, op: str, inputs, before: ir.Node, dtype: ir.DataType, shape=None, base="fp8", **attrs):
        name = self.names.value(base)
        output = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape) if shape is not None else None)
        node = ir.Node("", op, list(inputs), [ir.convenience.convert_attribute(k, v) for k, v in attrs.items()],
                       outputs=[output], name=self.names.node(name))
        before.graph.insert_before(before, node)
        return output

    def _constant(self, base: str, value: float, dtype=np.float32) -> ir.Value:
        return self._initializer(base, np.array(value, dtype=dtype), self.model.graph)

    def _shared_constant(self, name: str, value: float) -> ir.Value:
        """An fp32 scalar the scale computations share (one initializer per name in the model)."""
        if name not in self.constants:
            self.constants[name] = self._constant(f"fp8_{name}", value)
        return self.constants[name]

    def scale_of(self, amax: float) -> float:
        """The dequantizing scale for a tensor whose max |x| is `amax` (1 / fp8_runtime.current_scale's)."""
        return 1.0 / power_of_two_scale(amax, E4M3, self.options.margin)

    def activation(self, value: ir.Value, reader: ir.Node, amax: float | None) -> ir.Value:
        """DequantizeLinear(QuantizeLinear(value)): a static scale from `amax`, else one computed in the graph."""
        key, anchor = (value, reader.graph), reader   # before its first reader (the graph is in order)
        if key in self.quantized:
            return self.quantized[key]
        low_np = ir.DataType(self.low).numpy()
        base = f"{value.name}_fp8"
        if amax is not None:
            scale = self._constant(f"{base}_scale", max(self.scale_of(amax), SMALLEST_SCALE), low_np)
            self.static += 1
        else:
            scale = self._computed_scale(value, anchor, base)
            self.computed += 1
        # saturate=1 (the default for a float8 output): values past 448 * scale become +-448, not NaN
        q = self._node("QuantizeLinear", [value, scale], anchor, ir.DataType.FLOAT8E4M3FN, value.shape, f"{base}_q",
                       output_dtype=ir.DataType.FLOAT8E4M3FN.value)
        self.quantized[key] = self._node("DequantizeLinear", [q, scale], anchor, self.low, value.shape, f"{base}_dq")
        return self.quantized[key]

    def _computed_scale(self, value: ir.Value, anchor: ir.Node, base: str) -> ir.Value:
        """Current scaling as nodes: sx = 2 ** ceil(log2(max|x| / 448)) * 2 ** margin, in fp32, then `low`.
        log2 of a float may miss an exact power of two by one ulp: two exact comparisons correct the exponent."""
        def node(op, *inputs, dtype=_FLOAT, **attrs):
            return self._node(op, inputs, anchor, dtype, (), f"{base}_{op.lower()}", **attrs)
        c = self._shared_constant
        amax = node("ReduceMax", self._node("Abs", [value], anchor, self.low, value.shape, f"{base}_abs"),
                    dtype=self.low, keepdims=0)
        ratio = node("Div", node("Cast", amax, to=_FLOAT), c("e4m3_max", E4M3_MAX))
        ratio = node("Max", ratio, c("amax_floor_ratio", SMALLEST_SCALE))   # an all-zero x: finite scale
        guess = node("Pow", c("two", 2.0), node("Ceil", node("Mul", node("Log", ratio), c("inv_ln2", 1 / math.log(2)))))
        half = node("Div", guess, c("two", 2.0))
        guess = node("Where", node("GreaterOrEqual", half, ratio, dtype=ir.DataType.BOOL), half, guess)
        guess = node("Where", node("Less", guess, ratio, dtype=ir.DataType.BOOL),
                     node("Mul", guess, c("two", 2.0)), guess)
        if self.options.margin:
            guess = node("Mul", guess, c(f"margin_{self.options.margin}", 2.0 ** self.options.margin))
        return node("Cast", guess, dtype=self.low, to=self.low)

    def weight(self, value: ir.Value, reader: ir.Node) -> ir.Value | None:
        """DequantizeLinear of a FLOAT8E4M3FN copy of a 2-D initializer (read directly or through a Cast);
        None when `value` is not one. The source initializer goes when nothing else reads it."""
        source, perms = value, []
        while source is not None and source.producer() is not None and \
                (is_cast(source.producer()) or source.producer().op_type == "Transpose"):
            mover = source.producer()   # the exporter may leave Transpose(Cast(W)) of a large weight unfolded
            if mover.op_type == "Transpose":
                perms.append(mover.attributes.get_ints("perm", None) or (1, 0))
            source = mover.inputs[0]
        if source is None or source.producer() is not None or source.const_value is None or \
                len(source.const_value.shape) != 2:
            return None
        key = (source, tuple(map(tuple, perms)), reader.graph)
        if key in self.stored:
            return self.stored[key]
        array = np.asarray(source.const_value.numpy(), dtype=np.float32)
        for perm in reversed(perms):   # innermost first
            array = array.transpose(perm)
        scale = self.scale_of(float(np.abs(array).max()) if array.size else 0.0)
        scaled = array / np.float32(scale)   # in float32; by a power of two: exact
        codes = np.ascontiguousarray(np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(_E4M3_NUMPY))   # nearest even
        stored = self._initializer(f"{source.name}_e4m3", codes, reader.graph)
        self.weights += 1
        dq_scale = self._constant(f"{source.name}_e4m3_scale", scale, ir.DataType(self.low).numpy())
        self.stored[key] = self._node("DequantizeLinear", [stored, dq_scale], reader, self.low, value.shape,
                                      f"{source.name}_dq")
        return self.stored[key]

    def lower(self, node: ir.Node, amax: float | None) -> None:
        a, b = node.inputs[0], node.inputs[1]
        node.replace_input_with(0, self.activation(a, node, amax))
        weight = self.weight(b, node)
        node.replace_input_with(1, weight if weight is not None else self.activation(b, node, None))
        for gone in (b.producer(), b):   # the Casts/Transposes of a weight nothing else reads, then the weight
            _remove_if_unused(gone)


def _remove_if_unused(item) -> None:
    if isinstance(item, ir.Node) and (is_cast(item) or item.op_type == "Transpose") and \
            not any(o.uses() for o in item.outputs) and not any(o.is_graph_output() for o in item.outputs):
        source = item.inputs[0]
        item.graph.remove(item, safe=True)
        if source is not None:
            _remove_if_unused(source.producer() or source)
    elif isinstance(item, ir.Value) and item.producer() is None and not item.uses() and item.graph is not None \
            and item.name in item.graph.initializers and not item.is_graph_output() and not item.is_graph_input():
        del item.graph.initializers[item.name]


def _calibrated_amax(value: ir.Value) -> float | None:
    """max |value| over convert_onnx's calibration samples (passes/onnx/calibrate_ranges.py), looking through
    the Casts insert_casts added; None when not measured (the graph computes the scale)."""
    producer = value.producer()
    while producer is not None and is_cast(producer):
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    if producer is None or len(producer.outputs) != 1:
        return None
    measured = facts(producer).get("range") or {}
    amax = measured.get("max_abs")
    return float(amax) if amax is not None and math.isfinite(amax) and amax > 0 else None


def lower_onnx_fp8_matmuls(model: ir.Model, options: Fp8Options, low: ir.DataType, *, exported: bool) -> PassResult:
    """Lower the qualifying matmuls (module docstring); every low MatMul/Gemm convert_onnx painted gets its fp8
    rule. Counts: fp8 (lowered), kept (low matmuls left in `low`), static_scales / computed_scales
    (activation scales from calibration / computed in the graph), weights_e4m3 (weights stored float8)."""
    if options.scaling != "current":   # the entry points refuse it first (onnx/convert.py onnx_config); a direct
        raise ValueError(f"fp8_scaling={options.scaling!r} has no ONNX form (no amax history or row-wise scales "
                         "in a file); 'current' does")   # caller must not get another recipe than the one asked
    if model.opset_imports.get("", 1) < FP8_OPSET:
        raise ValueError(f"fp8 in ONNX needs opset >= {FP8_OPSET} (QuantizeLinear's output_dtype); the model has "
                         f"{model.opset_imports.get('', 1)}: fp8_opset(model) raises it")
    rewrite = _Fp8Rewrite(model, options, low)
    lowered = kept = 0
    matched: set[str] = set()
    recipe = onnx_recipe(options, low)
    for node in list(all_nodes(model.graph)):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
            continue
        if exported:   # convert() decided, and its rules are explain()'s rows
            if not is_export_marker(node):
                continue
            why = None
        else:
            amp = facts(node)
            if amp.get("precision") != "low":
                continue
            why = _kept_because(node, options, low, matched)
            amp["rule"] = f"{amp.get('rule', '')}; fp8: kept {dtype_name(low)}: {why}" if why else \
                f"fp8 ({recipe}): {amp.get('rule', '')}"
        if why is not None:
            kept += 1
            continue
        rewrite.lower(node, marker_amax(node) if exported else _calibrated_amax(node.inputs[0]))
        lowered += 1
    unmatched = [pattern for pattern in options.keep if pattern not in matched]
    if unmatched and not exported:   # as force_fp32's: a typo must not leave a matmul in fp8 silently
        raise ValueError(f"fp8_keep pattern(s) {unmatched} matched no low MatMul/Gemm's node name or module path")
    return PassResult(modified=bool(lowered), counts={"fp8": lowered, "kept": kept, "weights_e4m3": rewrite.weights,
                                                      "static_scales": rewrite.static,
                                                      "computed_scales": rewrite.computed})
