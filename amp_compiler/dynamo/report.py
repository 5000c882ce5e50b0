"""explain(model) for a model compiled by amp_compiler.compile: its graphs in one report, the user's module paths.

Each graph dynamo made is listed in the summary's notes, in the order it was made: its compile id ("frame/attempt":
an attempt after the first is a recompile, for new shapes, flags or guards), its size, and the graph break that ended
it with dynamo's reason and the user's line. Rows are every graph's nodes (a prefill and a decode graph both show
their attention). compare(model) replays each graph a call runs in fp32 on the tensors it received; verify(model)
checks each graph's dtypes on them.
"""
from __future__ import annotations

import contextlib
import dataclasses

from torch import nn

from amp_compiler.converted import compiled_record, converted_graphs
from amp_compiler.insight import compare as cmp
from amp_compiler.insight.report import PrecisionReport, add_calibration, explain, node_totals
from amp_compiler.insight.verify import DtypeMismatch, verify

NOT_CALLED = "not called yet: dynamo captures graphs on the model's calls, so there is nothing to report"


def explain_compiled(model, record) -> PrecisionReport:
    """One report of every graph of a compiled model (or of its compiled children: their paths prefixed)."""
    config = record.config
    rows, islands, casts, warnings, notes, pass_counts = [], [], 0, [], [], {}
    made = []
    for index, (prefix, gm) in enumerate(converted_graphs(model), 1):
        report = explain(gm)
        rows += [{**row, "module": _joined(prefix, row["module"])} for row in report.rows]
        islands += [{**island, "module": _joined(prefix, island["module"])} for island in report.islands]
        casts += report.totals["casts"]
        warnings += report.warnings
        notes.append(graph_line(index, gm, prefix))
        add_calibration(pass_counts, report.summary.get("pass_counts", {}).get("calibrate_ranges"))
        made.append(gm)
    notes += [record.note] if getattr(record, "note", "") else []
    forwards = record.forwards(model)
    fallbacks = [reason for forward in forwards for reason in forward.converter.fallbacks]
    notes += [f"fallback: {reason}" for reason in dict.fromkeys(fallbacks)]
    notes += [f"fallback: {forward.not_captured}" for forward in forwards if forward.not_captured]
    notes += list(dict.fromkeys(f"calibration: {why}" for forward in forwards   # shared calls
                                if forward.calibration is not None for why in forward.calibration.uncalibrated))
    recompiles = sum(1 for gm in made if not _compile_id(gm).endswith("/0"))
    breaks = sum(1 for gm in made if gm.meta["amp"].get("dynamo", {}).get("graph_break"))
    summary = {"level": config.level, "requested_level": config.requested_level, "dtype": config.low_dtype_name,
               "frontend": f"torch.dynamo: {len(made)} graph(s), {breaks} graph break(s), {recompiles} recompile(s)",
               "keep_io_types": config.keep_io_types, "loss_scale_manager": config.loss_scale_manager,
               "leaf_modules": [], "notes": notes or [NOT_CALLED],
               "opaque": {}, "hooks": {}, "training_reads": {},
               "casts": casts, "pass_counts": pass_counts, "in_place": True,
               "devices": made[0].meta["amp"].get("devices") if made else None}
    return PrecisionReport(rows, node_totals(rows, casts), summary, islands, warnings=warnings)


def _joined(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


def graph_line(index: int, gm, prefix: str = "") -> str:
    facts = gm.meta["amp"]
    dynamo = facts.get("dynamo", {})
    ended = f"; ends at a graph break: {dynamo['graph_break']}" if dynamo.get("graph_break") else ""
    bodies = f", {len(facts['bodies'])} checkpointed bod(ies)" if facts.get("bodies") else ""
    cached = facts.get("frozen", {}).get("weight_casts_frozen")
    cache = f", {cached} weight casts cached" if cached else ""
    of = f" of {prefix}" if prefix else ""
    return (f"graph {index}{of} (compile id {dynamo.get('compile_id') or '?'}): {facts.get('nodes_captured', '?')} nodes"
            f"{bodies}{cache}, converted in {facts.get('conversion_s', 0):.2f} s{ended}")


def _compile_id(gm) -> str:
    return gm.meta["amp"].get("dynamo", {}).get("compile_id") or "0/0"


def verify_compiled(model, inputs: tuple, kwargs: dict) -> None:
    """amp_compiler.verify(model, *inputs) on a model on dynamo's capture: one call captures what the inputs need,
    a second checks every graph (its nodes' dtypes against the recorded ones) on the tensors it receives. A
    mismatch raises after that call, naming the graph. Graphs run by inductor are not fx code: refused."""
    import torch

    forwards = compiled_record(model).forwards(model)
    if any(forward.options["backend"] != "eager" for forward in forwards):
        raise ValueError("verify() checks graphs run as fx code; this model's graphs run as inductor kernels: "
                         "verify a convert(model, inplace=True, capture='dynamo') copy instead")
    failures = []

    def check(gm, args):   # raised after the call, not inside dynamo's
        if not failures:
            try:
                verify(gm, *args)
            except (DtypeMismatch, ValueError) as error:
                failures.append((gm, error))

    with torch.no_grad():
        model(*inputs, **kwargs)
        made = converted_graphs(model)
        handles = [gm.register_forward_pre_hook(lambda gm, args: check(gm, args)) for _, gm in made]
        try:
            model(*inputs, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
    if failures:
        gm, error = failures[0]
        index = next(i for i, (_, made_gm) in enumerate(made, 1) if made_gm is gm)
        raise type(error)(f"{graph_line(index, gm)}: {error}") from error


# -- compare ------------------------------------------------------------------------------------------------
def compare_compiled(reference: nn.Module, model: nn.Module, inputs: tuple, rtol: float | None):
    """compare(reference, model, inputs) for a model on dynamo's capture: each graph the call runs, node by node,
    against its fp32 replay (casts as identities) on the tensors it received, in call order; the outputs against
    `reference` run as written in fp32 (`model` itself as written when it is `reference`). A graph after a graph
    break receives what the converted code before it computed: its nodes carry their own error, not that before."""
    import torch

    forwards = compiled_record(model).forwards(model)
    if any(forward.options["backend"] != "eager" for forward in forwards):
        raise ValueError("compare() replays graphs run as fx code; this model's graphs run as inductor kernels: "
                         "compare a convert(model, inplace=True) copy instead")
    calls = []
    with cmp._eval_mode(reference, model), torch.no_grad():
        cmp._run_model(model, inputs)   # captures the graphs these inputs need (eval, no grad are guarded)
        made = [gm for _, gm in converted_graphs(model)]
        handles = [gm.register_forward_pre_hook(
            lambda gm, args: calls.append((gm, tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a
                                                      for a in args)))) for gm in made]
        try:
            candidate_out = cmp._run_model(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        with running_as_written(model if reference is model else None):
            reference_out = cmp._run_model(reference, inputs)
        low = forwards[0].config.low_dtype_name if forwards else "float16"
        ran = list(dict.fromkeys(gm for gm, _ in calls))   # the graphs this call ran, judged as one model
        rtol, rtol_from = (rtol, "") if rtol is not None else \
            cmp.default_rtol(*ran) if ran else (cmp.DEFAULT_RTOL.get(low, 1e-2), f"{low} default")
        per_call = [_graph_errors(made.index(gm) + 1, gm, args, low, rtol) for gm, args in calls]
    outputs = [cmp._node_error(None, c, r, low, rtol, name=f"output[{i}]")
               for i, (c, r) in enumerate(zip(cmp._leaves(candidate_out), cmp._leaves(reference_out)))]
    errors = [error for call in per_call for error in call.values()]
    notes = [] if len(calls) < 2 else [f"{len(calls)} graph calls: each graph's nodes against its fp32 replay on the "
                                       "tensors it received (after a graph break, what the converted code computed)"]
    report = cmp.ComparisonReport(low, rtol, sorted(errors, key=cmp.badness, reverse=True), outputs,
                                  notes=notes, rtol_from=rtol_from)
    for call in per_call:   # the first failing node: graphs in call order, nodes in graph order
        first = next((node for node, error in call.items() if not error.ok), None)
        if first is not None:
            report.first_failure, report.chain = call[first], cmp._chain(first, call)
            break
    return report


def _graph_errors(index: int, gm, args: tuple, low: str, rtol: float) -> dict:
    """{node: NodeError} of one graph call, each node named with its graph ("graph 2: linear_1")."""
    low_values, _ = cmp._run(gm, args, fp32=False)
    fp32_values, _ = cmp._run(gm, args, fp32=True, scales=cmp.fp8_scales(gm, low_values))
    return {node: dataclasses.replace(cmp._node_error(node, low_values[node], fp32_values[node], low, rtol),
                                      node=f"graph {index}: {node.name}")
            for node in gm.graph.nodes if node in fp32_values and node in low_values}


@contextlib.contextmanager
def running_as_written(model: nn.Module | None):
    """Every compiled module of `model` runs its own forward (no dynamo) inside the block; compiled again after."""
    compiled = [(module, module.__dict__["forward"]) for module in (model.modules() if model is not None else ())
                if getattr(compiled_record(module), "runs_a_forward", False)]
    for module, forward in compiled:
        if forward.own_forward is not None:
            module.__dict__["forward"] = forward.own_forward
        else:
            module.__dict__.pop("forward")
    try:
        yield
    finally:
        for module, forward in compiled:
            module.__dict__["forward"] = forward
