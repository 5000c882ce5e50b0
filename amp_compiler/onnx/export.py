"""export_onnx(): the graph convert() builds, exported as an fp16 ONNX model for inference.

    model --capture (once)--> inference passes on the captured graph (eval batch norms folded into their
          convs, in-place activations out of place)--> compile_graph(level) --> GraphModule with explicit casts
          --torch.onnx.export(dynamo=True)--> ONNX --EXPORT_PIPELINE (print it)--> file

The precision of every op is the one convert() chose, with what inference changes said out loud:
- an inference graph has no BatchNorm: each eval-mode BatchNorm that follows a convolution is folded into it
  before convert() paints (passes/fx/fold_batch_norms.py says why before, not after), so an exported CNN has
  no fp32 BatchNorm islands and no more Casts than convert_onnx of the fp32 export; in-place activations
  run out of place where nothing else sees the write (the exported graph is functional either way, and
  convert() leaves in-place ops out of its painting: passes/fx/out_of_place_activations.py);
- fragile ops that torch.onnx writes out of a low-precision op (the Softmax of a decomposed
  scaled_dot_product_attention, the ReduceMean of a global average pool) run fp32, as the policy table says
  for every Softmax and reduction (widen_denied_ops);
- weights are stored once, in fp16 where every reader can take it: embedding tables read by a lookup
  (store_moved_weights_low) and a tied LM head's transposed copy (store_tied_weights_once);
- a weight that fp16 cannot hold (|x| > 65504) would reach the graph as inf, so the nodes reading it are
  compiled again from the same capture with force_fp32 and keep it exact;
- at level "fp8" (float16 around the matmuls by default: ONNX Runtime runs no bfloat16), convert() decides
  which matmuls run fp8, once (passes/fx/lower_fp8_matmuls.py), and writes each as a call of its export marker
  (Fp8Options.form "export_marker": fp8_runtime.fp8_export_markers(), no scaling nodes), which
  FP8_TRANSLATIONS writes as a plain MatMul tagged with its origin; the ONNX lower_fp8_matmuls then gives
  exactly those nodes their float8 operands (passes/onnx/lower_fp8_matmuls.py): FLOAT8E4M3FN weights, Q/DQ
  activations, opset >= 21. The activation scales are computed in the graph, or static with calibration_data
  (convert()'s measure of each matmul's x, carried by the marker).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import os
import re
import time
import warnings

import onnx_ir as ir
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.config import AmpConfig, make_config
from amp_compiler.graph_conversion import compile_graph
from amp_compiler.frontend import CapturedGraph, TracingError, capture, graph_module_to_compile
from amp_compiler.frontend.export_capture import settle_training_flag
from amp_compiler.onnx.convert import conversion_warnings, onnx_config
from amp_compiler.onnx.files import save_onnx_model, weight_bytes
from amp_compiler.onnx.progress import ConversionProgress, announcing
from amp_compiler.onnx.report import OnnxConversionReport, count_casts
from amp_compiler.insight.report import explain
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.fold_batch_norms import (find_foldable_batch_norms, fold_batch_norms_in_aten_graph,
                                                     fold_batch_norms_in_graph)
from amp_compiler.passes.fx.fp8_runtime import fp8_export_markers
from amp_compiler.passes.fx.out_of_place_activations import find_inplace_activations, make_out_of_place_in_graph
from amp_compiler.passes.fx.runtime import amp_cast, amp_module_call
from amp_compiler.passes.onnx.lower_fp8_matmuls import fp8_opset, onnx_recipe
from amp_compiler.passes.onnx.spec import ir_low_dtype, is_float_type
from amp_compiler.passes.painting.calibrate_ranges import check_calibration_data
from amp_compiler.passes.policy.numerics import FP16_MAX
from amp_compiler.passes.pipelines import EXPORT_PIPELINE, OnnxState
from amp_compiler.passes.node_facts import facts


def export_onnx(model: nn.Module, args, path, level: str = "O1", dtype=torch.float16, keep_io_types: bool = True,
                dynamic_shapes=None, progress: bool | None = None, calibration_data=None,
                **overrides) -> OnnxConversionReport:
    """Convert `model` at `level` and write it to `path` as ONNX (weights in `dtype` where ops run in it).

    `args` are example inputs (a tuple, or one tensor); `dynamic_shapes` follows torch.export. Keyword
    overrides are convert()'s (allow_ops, deny_ops, force_fp32, force_low, keep_batchnorm_fp32, ...).
    The export is an inference graph: dropout off, batch norm on running statistics (folded into the
    convolution before it where there is one; `model` itself is never changed).
    progress: a progress bar on stderr (None: only for an export past PROGRESS_AFTER_SECONDS, on a terminal).
    calibration_data: samples (tuples of the model's inputs) convert() calibrates on, as convert()'s; at the fp8
    level the activation scales become static (the max |x| each fp8 matmul's input reached on them).
    """
    started = time.perf_counter()
    args = args if isinstance(args, tuple) else (args,)
    check_calibration_data(calibration_data)
    calibration_data = list(calibration_data) if calibration_data is not None else None   # read by each compile
    config = export_config(level, dtype=dtype, keep_io_types=keep_io_types, **overrides)
    # steps: capture, convert, torch.onnx.export, each export pass, save
    with ConversionProgress(3 + len(EXPORT_PIPELINE.passes) + 1, enabled=progress, desc="export_onnx") as steps:
        steps.advance("capture")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)   # pytree deprecations inside torch.export
                captured = capture(model, args, dynamic_shapes)
        except TracingError as error:   # convert() would run it as written: an ONNX file needs one graph
            raise TracingError(f"export_onnx needs {type(model).__name__} as one graph, and neither torch.fx nor "
                               f"torch.export captures it: {str(error).splitlines()[0]}\nconvert() runs it as "
                               "written with its children converted; export a child that captures instead") from error
        captured, prepared = prepare_for_inference(captured, config)
        model = captured.model
        steps.advance("convert")
        gm = compile_graph(captured, config, calibration_data)
        kept, notes = _weights_beyond_fp16(gm) if config.low_dtype == torch.float16 else ((), [])
        if kept:   # the same capture, compiled again with the nodes reading those weights forced fp32
            force = (*_as_tuple(overrides.pop("force_fp32", ())), *kept)
            gm = compile_graph(captured, export_config(level, dtype=dtype, keep_io_types=keep_io_types,
                                                       force_fp32=force, **overrides), calibration_data)
        gm.eval()
        rows = export_rows(gm, config)
        steps.advance("torch.onnx.export")
        try:
            onnx_model = _export(gm, args, dynamic_shapes, fp8=config.fp8 is not None)
        except Exception as error:
            failed = autograd_function_failure(gm, model, error)
            if failed is None:
                raise
            raise failed from error
        report = OnnxConversionReport(type(model).__name__, os.fspath(path), config.level, config.low_dtype_name,
                                      config.keep_io_types, weight_bytes_before=fp32_weight_bytes(onnx_model),
                                      warnings=notes)
        counts = run_export_pipeline(onnx_model, config, gm, on_pass=steps.advance)
        steps.saving()
        save_onnx_model(onnx_model, path, callback=steps.tensor_written)
    report.pass_counts = {**prepared, **counts}
    report.rows = rows
    report.casts, report.weight_bytes_after = count_casts(onnx_model), weight_bytes(onnx_model)
    report.warnings += conversion_warnings(counts)
    report.seconds = time.perf_counter() - started
    return report


def export_rows(gm: fx.GraphModule, config: AmpConfig | None = None) -> list[dict]:
    """The report's rows: explain()'s, one per fx node of the exported graph, with its fp32 island. At the fp8
    level an fp8 matmul's rule names the ONNX form (Q/DQ, float8 weights) where explain() names _scaled_mm."""
    explained = explain(gm)
    island_of = {node: i for i, island in enumerate(explained.islands) for node in island["nodes"]}
    # no closing parenthesis: a calibrated matmul's rule goes on with its measured error inside it
    torch_recipe = f"fp8 ({config.fp8.recipe()}" if config is not None and config.fp8 is not None else None
    onnx_form = f"fp8 ({onnx_recipe(config.fp8, ir_low_dtype(config.low_dtype_name))}" if torch_recipe else None
    return [{"node": r["node"], "op_type": "(fx)", "op": r["op"], "precision": r["dtype"],
             "rule": r["rule"].replace(torch_recipe, onnx_form, 1) if torch_recipe and r["rule"] else r["rule"],
             "module": r["module"], "class": r["class"], "island": island_of.get(r["node"], -1)}
            for r in explained.rows]


def export_config(level: str, **options) -> AmpConfig:
    """onnx_config for export_onnx: at the fp8 level convert()'s fx pass writes each fp8 matmul it decides as its
    export marker (Fp8Options.form "export_marker"), which torch.onnx can write, instead of _scaled_mm."""
    config = onnx_config("export_onnx", level, **options)
    if config.fp8 is not None:
        config.fp8 = dataclasses.replace(config.fp8, form="export_marker")
    return config


def _linear_onnx(x, weight, bias=None, x_amax=-1.0):
    from onnxscript import opset19 as op
    y = op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
    return y if bias is None else op.Add(y, bias)


def _matmul_onnx(a, b, bias=None, x_amax=-1.0):
    from onnxscript import opset19 as op
    y = op.MatMul(a, b)
    return y if bias is None else op.Add(y, bias)


# The fp8 export markers (passes/fx/fp8_runtime.py), as torch.onnx writes them: a plain MatMul (+ Add) whose
# metadata names the marker and carries its x_amax, which lower_fp8_matmuls (ONNX) finds and lowers
FP8_TRANSLATIONS = dict(zip(fp8_export_markers(), (_linear_onnx, _matmul_onnx)))


def inference_counts() -> dict:
    return {"fold_batch_norms": {"batch_norms_folded": 0},
            "out_of_place_activations": {"activations_made_out_of_place": 0}}


def prepare_for_inference(captured: CapturedGraph, config: AmpConfig) -> tuple[CapturedGraph, dict]:
    """The capture made an inference graph by passes on it (its module tree is its own, the user's model is
    never changed): eval BatchNorms folded into the convolutions before them (fold_batch_norms), in-place
    activations out of place where nothing else sees the write (out_of_place_activations). Returns the capture
    to compile, with what each step counted. Not at O0 (nothing is converted; torch.onnx's optimizer folds
    batch norms in an fp32 export), not for a norm a force_* pattern names. A torch.export capture's ATen graph
    is rewritten too (fold_batch_norms_in_aten_graph; its in-place ops are functional already): the model is
    never captured again."""
    counts = inference_counts()
    if not config.level_spec.paints or not any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) or getattr(m, "inplace", False) is True
            for m in captured.graph_module.modules()):
        return captured, counts
    analysed, rules = graph_module_to_compile(captured), config.precision_rules()   # facts on a copy
    canonicalize(analysed)
    norms = [p for p in find_foldable_batch_norms(analysed) if rules.forced(p.norm, p.nodes[1]) is None]
    activations = find_inplace_activations(analysed) if captured.frontend == "fx.symbolic_trace" else []
    if not norms and not activations:
        return captured, counts
    gm = captured.graph_module
    folded = {pair.norm for pair in norms}   # nn.Identity now: traced through, no hooks
    captured.hooked = {path: kinds for path, kinds in captured.hooked.items() if path not in folded}
    if captured.frontend != "fx.symbolic_trace":   # torch.export: ATen ops, the norms' train flag settled
        counts["fold_batch_norms"] = fold_batch_norms_in_aten_graph(gm, norms).counts
        captured.notes = settle_training_flag(gm, captured.notes)
        return captured, counts
    counts["fold_batch_norms"] = fold_batch_norms_in_graph(gm, norms).counts
    counts["out_of_place_activations"] = make_out_of_place_in_graph(gm, activations).counts
    captured.leaves = sorted({n.target for n in gm.graph.nodes if n.op == "call_module"})
    return captured, counts


def run_export_pipeline(model: ir.Model, config: AmpConfig, gm: fx.GraphModule | None = None, *,
                        on_pass=None) -> dict:
    """EXPORT_PIPELINE: the ONNX passes an exported graph needs; its precisions were decided by convert()
    (`gm`, the converted graph that was exported). on_pass(name) is called as each pass starts."""
    low_families = frozenset(facts(n).get("family") for n in gm.graph.nodes
                             if facts(n).get("precision") == "low") if gm is not None else frozenset()
    return announcing(EXPORT_PIPELINE, on_pass).run(OnnxState(model, config, exported=True, low_families=low_families))


def export_fp32_reference(model: nn.Module, args: tuple, path, dynamic_shapes=None) -> None:
    """The unconverted model as ONNX (eval mode): the reference validate_onnx compares against."""
    was_training = model.training
    model.eval()
    try:
        save_onnx_model(_export(model, args, dynamic_shapes), path)
    finally:
        model.train(was_training)


def _export(module: nn.Module, args: tuple, dynamic_shapes, fp8: bool = False) -> ir.Model:
    with warnings.catch_warnings(), _quiet("torch.onnx._internal.exporter._registration"), \
            contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore", FutureWarning)   # pytree deprecations inside torch.export
        program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False,
                                    custom_translation_table=FP8_TRANSLATIONS if fp8 else None)
    if fp8:
        fp8_opset(program.model)   # torch 2.13 writes opset 20: raised to FP8_OPSET (21) by the version converter
    return program.model


def autograd_function_failure(gm: fx.GraphModule, model: nn.Module, error: Exception) -> TracingError | None:
    """One line for a torch.onnx failure inside a custom autograd.Function the graph keeps whole (an opaque call
    of Fn.apply), instead of torch.onnx's page; None when the failure is elsewhere."""
    chain, cause = [], error
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = "\n".join(str(e) for e in chain)
    for node in gm.graph.nodes:
        if "custom autograd.Function" not in str(node.meta.get("amp_opaque", "")) or \
                not re.search(rf"%{re.escape(node.name)}\b", text):
            continue
        function = getattr(operator.attrgetter(node.args[0].target)(gm), "__self__", None)
        name = getattr(function, "__qualname__", node.name)
        why = next((line for e in reversed(chain) for line in str(e).splitlines() if line.strip()), type(error).__name__)
        return TracingError(f"export_onnx: {type(model).__name__} calls the custom autograd.Function {name}, which "
                            f"torch.onnx cannot write: it traces {name}.forward with torch.export, which fails on it "
                            f"({type(chain[-1]).__name__}: {why.strip()[:160]}); write that forward with torch ops "
                            "torch.export can trace, or make it a torch.library custom op and give torch.onnx.export "
                            "an ONNX translation for it (custom_translation_table)")
    return None


def _weights_beyond_fp16(gm: fx.GraphModule) -> tuple[tuple[str, ...], list[str]]:
    """force_fp32 patterns for the ops that read a weight fp16 cannot hold, and the notes to report."""
    patterns: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (amp_cast, amp_module_call) or \
                node.args[1] != torch.float16 or getattr(node.args[0], "op", None) != "get_attr":
            continue
        owner = operator.attrgetter(node.args[0].target)(gm)
        tensors = dict(owner.named_parameters()) if isinstance(owner, nn.Module) else {"": owner}
        for name, tensor in tensors.items():
            peak = _peak(tensor)
            if peak <= FP16_MAX:
                continue
            readers = [node] if node.target is amp_module_call else list(node.users)
            where = ".".join(p for p in (node.args[0].target, name) if p)
            for reader in readers:
                pattern = facts(reader).get("module") or reader.name
                patterns.setdefault(pattern, f"{where} holds |x| up to {peak:.6g} > {FP16_MAX:g} (fp16 max): "
                                             f"{pattern!r} exported in fp32")
    return tuple(patterns), list(patterns.values())


def _peak(tensor) -> float:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.float32, torch.float64) or \
            tensor.numel() == 0:
        return 0.0
    finite = tensor.detach().abs()
    finite = finite[torch.isfinite(finite)]
    return float(finite.max()) if finite.numel() else 0.0


def fp32_weight_bytes(model: ir.Model) -> int:
    """What the exported initializers would take with every float tensor in fp32 (an fp32 export)."""
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += tensor.size * 4 if is_float_type(tensor.dtype) else tensor.nbytes
    return total


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """The exporter logs a warning per optional torchvision op on every export: not the user's concern."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
