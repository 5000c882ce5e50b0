"""export_onnx / convert_onnx at level "fp8": float8 matmuls in an ONNX file (passes/onnx/lower_fp8_matmuls.py).

The model has two linears that qualify (K, N multiples of 16, fp8_min_dim=16) and a ragged one (N=4). The
tests read the file (Q/DQ nodes, FLOAT8E4M3FN initializers, their scales), run it in ONNX Runtime's CPU
provider, and compare with an emulation written here: float16 values, each fp8 operand rounded to e4m3 with
its power-of-two scale (the smallest power of two s with max|v| <= 448 s). Against fp32 torch the file's error
is fp8's (~0.06 relative on this model, float16's would be ~1e-3); against the emulation it is float16
rounding (~4e-4): a matmul left out of fp8, a weight in the wrong layout or a value that does not saturate
moves it by fp8's error. A power-of-two scale off by a factor of two changes only exponents (e4m3 is a
floating-point format: nothing moves unless values reach its subnormals), so the scales are checked as values:
the weights' stored ones, the calibrated one, and the ones the graph computes (read out of ONNX Runtime).
"""
import math

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import amp_compiler

ort = pytest.importorskip("onnxruntime")

E4M3 = torch.float8_e4m3fn
FP8_ERROR = 0.12     # relative error of the file vs fp32 torch: fp8's (e4m3, 3 mantissa bits), measured 0.06-0.07
FP16_ERROR = 1e-2    # vs the emulation: float16 rounding only, measured ~1e-3
FP8_RAN = 0.02       # the error against fp32 is above this: fp8 did run (float16 alone gives ~1e-3)


class ThreeLinears(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, width), nn.Linear(width, 32), nn.Linear(32, 4)   # c: N=4, ragged

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def model_and_input(width=64):
    torch.manual_seed(0)
    return ThreeLinears(width).eval(), torch.randn(2, 8, 32)


def run_onnx(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def e4m3_round_trip(v: torch.Tensor) -> torch.Tensor:
    """v through e4m3 with the current power-of-two scale, written out here (independent of the pass)."""
    amax = v.abs().max().item()
    scale = 2.0 ** math.ceil(math.log2(amax / 448))
    while amax > 448 * scale:   # log2 of a float can miss a power of two: settle it exactly
        scale *= 2
    while amax <= 448 * scale / 2:
        scale /= 2
    return (v.float() / scale).clamp(-448, 448).to(E4M3).float() * scale


def emulate(model: ThreeLinears, x: torch.Tensor, weights_from=torch.float16) -> np.ndarray:
    """The fp8 file's arithmetic: float16 values, a and b with e4m3 operands, c in float16. export_onnx
    quantizes the float16 weights torch.onnx wrote, convert_onnx the float32 ones of its source (5 of a's 2048
    weights round differently)."""
    def linear(h, layer, fp8):
        w, b = layer.weight.detach().half(), layer.bias.detach().half()
        if fp8:
            h, w = e4m3_round_trip(h).half(), e4m3_round_trip(layer.weight.detach().to(weights_from)).half()
        return (h.float() @ w.float().t() + b.float()).half()
    h = x.half()
    h = torch.relu(linear(h, model.a, True))
    h = torch.relu(linear(h, model.b, True))
    return linear(h, model.c, False).float().numpy()


def fp8_weights(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN and t.dims}


def ops(proto: onnx.ModelProto, op_type: str) -> list:
    return [n for n in proto.graph.node if n.op_type == op_type]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, x = model_and_input()
    path = tmp_path_factory.mktemp("fp8") / "model_fp8.onnx"
    report = amp_compiler.export_onnx(model, (x,), path, "fp8", fp8_min_dim=16)
    return model, x, path, report


def test_two_matmuls_read_float8_operands_and_the_ragged_one_keeps_float16(exported):
    model, x, path, report = exported
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain or "": o.version for o in proto.opset_import}[""] >= 21   # output_dtype (FP8_OPSET)
    assert len(ops(proto, "QuantizeLinear")) == 2           # the two activations
    dequantized = {n.output[0] for n in ops(proto, "DequantizeLinear")}
    assert len(dequantized) == 4                            # ... and the two weights
    matmuls = ops(proto, "MatMul") + ops(proto, "Gemm")
    fp8 = [n for n in matmuls if set(n.input[:2]) <= dequantized]
    plain = [n for n in matmuls if not set(n.input[:2]) & dequantized]
    assert len(fp8) == 2 and len(plain) == 1
    weights = fp8_weights(proto)
    assert sorted(tuple(t.dims) for t in weights.values()) == [(32, 64), (64, 32)]   # stored (K, N), float8
    rules = {r["node"]: r["rule"] for r in report.rows if r["op"] == "linear"}
    assert sum(rule.startswith("fp8 (e4m3 QuantizeLinear/DequantizeLinear") for rule in rules.values()) == 2
    assert [rule for rule in rules.values() if "fp8: kept float16: N=4 not a multiple of 16" in rule]
    assert report.pass_counts["lower_fp8_matmuls"]["fp8"] == 2


def test_export_decides_once_and_writes_each_fp8_matmul_as_its_marker():
    """export_onnx's graph is lowered once: the fx pass decides as convert() does (the same rules, node by node)
    and writes each fp8 matmul as its export marker on the operands it would quantize, calibrated amax last, with
    no scaling nodes and no _scaled_mm to take apart again; the report lists no fp8 scaling rows."""
    from amp_compiler.frontend import capture
    from amp_compiler.graph_conversion import compile_graph
    from amp_compiler.onnx.convert import onnx_config
    from amp_compiler.onnx.export import export_config
    from amp_compiler.passes.fx import fp8_runtime
    from amp_compiler.passes.node_facts import facts
    from amp_compiler.passes.policy.fp8 import NO_AMAX
    model, x = model_and_input()
    captured = capture(model, (x,))
    marked = compile_graph(captured, export_config("fp8", fp8_min_dim=16))
    scaled = compile_graph(captured, onnx_config("export_onnx", "fp8", fp8_min_dim=16))
    targets = [n.target for n in marked.graph.nodes if n.op == "call_function"]
    linear_marker, _ = fp8_runtime.fp8_export_markers()
    assert targets.count(linear_marker) == 2
    helpers = {fp8_runtime.fp8_amax, fp8_runtime.fp8_scale, fp8_runtime.fp8_cast, fp8_runtime.fp8_scaled_linear}
    assert not helpers & set(targets) and helpers <= {n.target for n in scaled.graph.nodes}
    markers = [n for n in marked.graph.nodes if n.target is linear_marker]
    assert all(len(n.args) == 4 and n.args[3] == NO_AMAX for n in markers)
    decided = lambda gm: {n.name: facts(n)["rule"] for n in gm.graph.nodes if facts(n).get("family") == "matmul"}  # noqa: E731
    assert decided(marked) == decided(scaled) and len(decided(marked)) == 3


def test_the_report_lists_no_torch_scaling_nodes(exported):
    _, _, _, report = exported
    assert not [r for r in report.rows if r["op"] in ("fp8_amax", "fp8_scale", "fp8_cast")]


def test_weight_scales_are_the_smallest_powers_of_two_that_hold_the_weight(exported):
    model, _, path, _ = exported
    proto = onnx.load(path)
    initializers = {t.name: t for t in proto.graph.initializer}
    for dq in ops(proto, "DequantizeLinear"):
        stored = initializers.get(dq.input[0])
        if stored is None:
            continue   # an activation's
        codes = torch.from_numpy(numpy_helper.to_array(stored).astype(np.float32))
        scale = float(numpy_helper.to_array(initializers[dq.input[1]]))
        assert math.log2(scale) == round(math.log2(scale)), scale
        layer = model.a if tuple(stored.dims) == (32, 64) else model.b
        weight = layer.weight.detach().half().float().t()
        amax = weight.abs().max().item()
        assert 448 * scale / 2 < amax <= 448 * scale            # the smallest such power of two
        assert torch.equal(codes * scale, e4m3_round_trip(weight))


def test_onnx_runtime_output_is_within_fp8_error(exported):
    model, x, path, _ = exported
    out = run_onnx(path, x)
    reference = model(x).detach().numpy()
    error = relative(out, reference)
    assert FP8_RAN < error < FP8_ERROR, f"{error:.3g} vs fp32 torch"
    assert relative(out, emulate(model, x)) < FP16_ERROR
    fx_fp8 = amp_compiler.convert(model, "fp8", example_inputs=(x,), fp8_min_dim=16)(x).float().detach().numpy()
    assert relative(out, fx_fp8) < FP8_ERROR   # both are fp8 (bf16 around it in torch): measured 0.045


@pytest.mark.parametrize("margin", [0, 2])
def test_the_graph_computes_the_smallest_power_of_two_scale_at_the_margin(tmp_path, margin):
    model, x = model_and_input()
    amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", fp8_min_dim=16, fp8_margin=margin)
    proto = onnx.load(tmp_path / "m.onnx")
    quantized = {q.input[0]: q.input[1] for q in ops(proto, "QuantizeLinear")}   # value -> its scale
    for name in (*quantized, *quantized.values()):
        proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()],
                      session.run(None, {session.get_inputs()[0].name: x.numpy()})))
    assert len(quantized) == 2
    for value, scale_name in quantized.items():
        amax, scale = float(np.abs(values[value]).max()), float(values[scale_name]) / 2 ** margin
        assert math.log2(scale) == round(math.log2(scale)) and 448 * scale / 2 < amax <= 448 * scale, (amax, scale)


def test_the_file_is_smaller_than_the_fp16_export_by_half_the_fp8_weights(tmp_path):
    model, x = model_and_input(width=1024)
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp16.onnx", "O1")
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp8.onnx", "fp8", fp8_min_dim=16)
    fp8_elements = 2 * 32 * 1024   # a and b
    saved = (tmp_path / "fp16.onnx").stat().st_size - (tmp_path / "fp8.onnx").stat().st_size
    # 2 bytes -> 1 per weight, less the scaling nodes written in their place (3.3 KB for the two)
    assert fp8_elements - 5000 < saved <= fp8_elements


def test_convert_onnx_of_the_fp32_file(tmp_path):
    model, x = model_and_input()
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
    report = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", tmp_path / "fp8.onnx", "fp8", fp8_min_dim=16)
    proto = onnx.load(tmp_path / "fp8.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert len(fp8_weights(proto)) == 2 and len(ops(proto, "QuantizeLinear")) == 2
    assert report.pass_counts["lower_fp8_matmuls"] == {"fp8": 2, "kept": 1, "weights_e4m3": 2, "static_scales": 0,
                                                       "computed_scales": 2}
    assert sum(r["rule"].startswith("fp8 (") for r in report.rows) == 2
    assert [r for r in report.rows if "fp8: kept float16: N=4" in r["rule"]]
    out = run_onnx(tmp_path / "fp8.onnx", x)
    assert FP8_RAN < relative(out, model(x).detach().numpy()) < FP8_ERROR
    assert relative(out, emulate(model, x, weights_from=torch.float32)) < FP16_ERROR


def test_convert_onnx_with_calibration_writes_a_static_scale(tmp_path):
    model, x = model_and_input()
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
    samples = [(torch.randn(2, 8, 32),) for _ in range(4)]
    report = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", tmp_path / "fp8.onnx", "fp8", fp8_min_dim=16,
                                       calibration_data=samples)
    counts = report.pass_counts["lower_fp8_matmuls"]
    assert counts["static_scales"] == 1 and counts["computed_scales"] == 1   # relu's output; x is a graph input
    proto = onnx.load(tmp_path / "fp8.onnx")
    initializers = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    static = [q for q in ops(proto, "QuantizeLinear") if q.input[1] in initializers]
    assert len(static) == 1
    amax = max(torch.relu(model.a(s[0])).abs().max().item() for s in samples)
    scale = float(initializers[static[0].input[1]])
    assert 448 * scale / 2 < amax <= 448 * scale
    assert relative(run_onnx(tmp_path / "fp8.onnx", x), model(x).detach().numpy()) < FP8_ERROR


def test_a_calibrated_fp8_matmuls_rule_names_the_onnx_form_with_its_measured_error(tmp_path):
    """The report's rule is the file's (Q/DQ, float16 out), not convert()'s _scaled_mm, with calibration too."""
    model, x = model_and_input()
    samples = [(torch.randn(2, 8, 32),) for _ in range(4)]
    report = amp_compiler.export_onnx(model, (x,), tmp_path / "fp8.onnx", "fp8", fp8_min_dim=16,
                                      calibration_data=samples)
    fp8_rules = [r["rule"] for r in report.rows if r["op"] == "linear" and r["rule"].startswith("fp8 (")]
    assert len(fp8_rules) == 2
    for rule in fp8_rules:
        assert rule.startswith("fp8 (e4m3 QuantizeLinear/DequantizeLinear around the matmul, weight stored "
                               "FLOAT8E4M3FN, out float16")
        assert "_scaled_mm" not in rule and "calibrated e4m3 error x " in rule and "(per tensor, 4 samples)" in rule


@pytest.mark.parametrize("how", ["export_onnx", "convert_onnx"])
def test_an_activation_calibrated_all_zero_gets_a_computed_scale(tmp_path, how):
    """Samples on which x is 0 everywhere measure amax 0: no range. A static scale from it (the smallest) made
    every later nonzero x saturate near 0. Computed instead. (No biases: relu(a(0)) is 0 too; with biases the
    zeros measure relu(bias), a real amax whose static scale saturates on x, as calibration means it to.)"""
    model, x = model_and_input()
    for linear in (model.a, model.b, model.c):
        nn.init.zeros_(linear.bias)
    zeros = [(torch.zeros(2, 8, 32),)]
    if how == "export_onnx":
        report = amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", fp8_min_dim=16,
                                          calibration_data=zeros)
    else:
        amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
        report = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", tmp_path / "m.onnx", "fp8", fp8_min_dim=16,
                                           calibration_data=zeros)
    error = relative(run_onnx(tmp_path / "m.onnx", x), model(x).detach().numpy())
    assert FP8_RAN < error < FP8_ERROR, error
    counts = report.pass_counts["lower_fp8_matmuls"]
    assert (counts["static_scales"], counts["computed_scales"]) == (0, 2)


def test_export_with_calibration_writes_static_scales(tmp_path):
    model, x = model_and_input()
    samples = [(torch.randn(2, 8, 32),) for _ in range(4)]
    report = amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", fp8_min_dim=16,
                                      calibration_data=iter(samples))   # an iterator: read by each compile
    counts = report.pass_counts["lower_fp8_matmuls"]
    assert counts["static_scales"] == 2 and counts["computed_scales"] == 0
    proto = onnx.load(tmp_path / "m.onnx")
    initializers = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    scales = sorted(float(initializers[q.input[1]]) for q in ops(proto, "QuantizeLinear"))
    with torch.no_grad():   # x and relu(a(x)) over the samples, in float16 as the fp8 model reads them
        amaxes = sorted([max(s[0].half().abs().max().item() for s in samples),
                         max(torch.relu(model.a(s[0])).half().abs().max().item() for s in samples)])
    for amax, scale in zip(amaxes, scales):
        assert 448 * scale / 2 < amax <= 448 * scale, (amax, scale)
    assert relative(run_onnx(tmp_path / "m.onnx", x), model(x).detach().numpy()) < FP8_ERROR


def test_fp8_keep_is_honoured_on_both_entry_points(tmp_path):
    model, x = model_and_input()
    report = amp_compiler.export_onnx(model, (x,), tmp_path / "keep.onnx", "fp8", fp8_min_dim=16, fp8_keep=["b"])
    proto = onnx.load(tmp_path / "keep.onnx")
    assert [tuple(t.dims) for t in fp8_weights(proto).values()] == [(32, 64)]   # a only
    assert [r for r in report.rows if "fp8: kept float16: user rule: fp8_keep 'b'" in r["rule"]]
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
    converted = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", tmp_path / "keep2.onnx", "fp8", fp8_min_dim=16,
                                          fp8_keep=["a"])
    assert converted.pass_counts["lower_fp8_matmuls"]["fp8"] == 1
    assert [tuple(t.dims) for t in fp8_weights(onnx.load(tmp_path / "keep2.onnx")).values()] == [(64, 32)]
    with pytest.raises(ValueError, match="fp8_keep pattern"):
        amp_compiler.convert_onnx(tmp_path / "fp32.onnx", None, "fp8", fp8_min_dim=16, fp8_keep=["nothing"])


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.square = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.square(torch.relu(self.square(x)))


def test_a_weight_two_matmuls_read_is_stored_once_in_float8(tmp_path):
    torch.manual_seed(0)
    model, x = SharedWeight().eval(), torch.randn(2, 8, 32)
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
    for path in (tmp_path / "export.onnx", tmp_path / "convert.onnx"):
        if path.name == "export.onnx":
            report = amp_compiler.export_onnx(model, (x,), path, "fp8", fp8_min_dim=16)
        else:
            report = amp_compiler.convert_onnx(tmp_path / "fp32.onnx", path, "fp8", fp8_min_dim=16)
        assert report.pass_counts["lower_fp8_matmuls"]["fp8"] == 2
        proto = onnx.load(path)
        assert len(fp8_weights(proto)) == 1, path.name
        assert not [t for t in proto.graph.initializer if tuple(t.dims) == (32, 32) and
                    t.data_type != onnx.TensorProto.FLOAT8E4M3FN], path.name   # no fp16/fp32 copy left
        assert relative(run_onnx(path, x), model(x).detach().numpy()) < FP8_ERROR


def test_the_float8_weight_codes_round_as_torchs_cast():
    """The ONNX pass writes a weight's e4m3 codes with numpy (ml_dtypes; it imports no torch): the codes torch's
    saturating cast gives, at every e4m3 value, every midpoint between two (ties to even) and one float32 ulp
    either side, subnormals included, and on a stride through every float32 bit pattern."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = np.sort(codes[np.isfinite(codes)])
    middles = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    strided = np.arange(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([codes, middles, np.nextafter(middles, np.float32(np.inf)),
                             np.nextafter(middles, np.float32(-np.inf)), strided[np.isfinite(strided)]])
    values = np.clip(values, -448, 448)   # the pass clamps first, as saturating_cast does
    from_numpy = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    from_torch = torch.from_numpy(values.copy()).to(E4M3).view(torch.uint8).numpy()
    assert np.array_equal(from_numpy, from_torch)


def test_a_source_below_opset_21_is_raised(tmp_path):
    model, x = model_and_input()
    amp_compiler.export_onnx(model, (x,), tmp_path / "fp32.onnx", "O0")
    old = onnx.version_converter.convert_version(onnx.load(tmp_path / "fp32.onnx"), 17)
    onnx.save(old, tmp_path / "opset17.onnx")
    amp_compiler.convert_onnx(tmp_path / "opset17.onnx", tmp_path / "fp8.onnx", "fp8", fp8_min_dim=16)
    proto = onnx.load(tmp_path / "fp8.onnx")
    assert {o.domain or "": o.version for o in proto.opset_import}[""] >= 21   # output_dtype (FP8_OPSET)
    assert len(fp8_weights(proto)) == 2
    assert relative(run_onnx(tmp_path / "fp8.onnx", x), model(x).detach().numpy()) < FP8_ERROR


def test_bfloat16_around_fp8_passes_the_checker(tmp_path):
    model, x = model_and_input()
    amp_compiler.export_onnx(model, (x,), tmp_path / "bf16.onnx", "fp8", dtype=torch.bfloat16, fp8_min_dim=16)
    proto = onnx.load(tmp_path / "bf16.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert len(fp8_weights(proto)) == 2
    try:
        ort.InferenceSession(str(tmp_path / "bf16.onnx"), providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ONNX Runtime's CPU provider has no bfloat16 MatMul/Q/DQ kernels
        pytest.skip(f"ONNX Runtime cannot run the bfloat16 file on CPU: {str(error).splitlines()[0][:120]}")


def test_options_errors(tmp_path):
    model, x = model_and_input()
    with pytest.raises(ValueError, match="no ONNX form"):
        amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", fp8_scaling="rowwise")
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", dtype=torch.float32)
    with pytest.raises(ValueError, match="fp8_min_dim"):
        amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "fp8", fp8_min_dim=-1)
    with pytest.raises(ValueError, match="apply to level 'fp8' only"):
        amp_compiler.export_onnx(model, (x,), tmp_path / "m.onnx", "O1", fp8_min_dim=16)
    with pytest.raises(ValueError, match="bfloat16"):   # torch's fp8 level keeps bfloat16 around the matmuls
        amp_compiler.convert(model, "fp8", dtype=torch.float16)
    assert not (tmp_path / "m.onnx").exists()
