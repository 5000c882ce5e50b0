"""explain / render / compare / verify on a model converted in place: its parts' graphs as ONE report.

    amp_compiler.explain(model)      # model = convert(model, "O1", inplace=True), called once
    parts: 11 graphs, 12 as written (17 captures)
      graphs (11): model.layers.[0-1].self_attn.{q_proj,k_proj,v_proj,o_proj}, model.layers.[0-1].mlp, lm_head
      as written (6), called with a transformers.cache_utils.DynamicCache argument (...): (top level), model, ...
      as written (6), nothing in it runs low at this level (...): model.{embed_tokens,norm}, ...
    ... then the rows of every part's graph, under the user's module paths (report_text.parts_lines)

A part's graph names its modules "inner.xxx" (BoundCall.inner is the part's module): rows, islands, leaf
modules, hooks and training reads are renamed "<part path>.xxx". A part with several graphs (train and
eval, or recaptured for other constants or shapes) shows the rows of its LATEST capture; the parts block
says how many graphs it holds. compare() takes its fp32 reference from the model run as written (every part's
own forward: running_as_written), verify() checks each graph on the inputs it receives in a real call.
"""
from __future__ import annotations

import re

import contextlib
import dataclasses

import torch
from torch import nn

from amp_compiler.in_place.call_key import Uncapturable, call_key
from amp_compiler.in_place.conversion import InPlaceConversion, in_place_conversion
from amp_compiler.in_place.part import Graph, Part
from amp_compiler.insight.report import PrecisionReport, _totals, add_calibration, explain

NOT_CALLED = ("nothing captured yet: parts are captured on their first call; call the model once or pass "
              "example_inputs to convert()")
GRAPH, AS_WRITTEN, NOT_CALLED_YET = "graph", "as written", "not called yet"


# -- explain -----------------------------------------------------------------------------------------------
def explain_in_place(model: nn.Module) -> PrecisionReport:
    """The parts' latest graphs merged into one report whose paths are the user's module paths."""
    conversion = in_place_conversion(model)
    rows, islands, casts, warnings = [], [], 0, []
    summaries = []
    for part, graph in shown_graphs(conversion):
        report = explain(graph.gm)
        summaries.append((part.path, report.summary))
        rows += [{**row, "module": user_path(part.path, row["module"])} for row in report.rows]
        islands += [{**island, "module": user_path(part.path, island["module"])} for island in report.islands]
        casts += report.totals["casts"]
        warnings += [f"{part.name}: {warning}" for warning in report.warnings]
    return PrecisionReport(rows, _totals(rows, casts), merged_summary(conversion, summaries), islands,
                           warnings=warnings)


def shown_graphs(conversion: InPlaceConversion) -> list[tuple[Part, Graph]]:
    """Each part that holds graphs with its latest one (captured last), parts in the model's module order."""
    return [(part, max(_graphs(part), key=_capture_number)) for part in ordered_parts(conversion) if _graphs(part)]


def ordered_parts(conversion: InPlaceConversion) -> list[Part]:
    order = {path: index for index, (path, _) in enumerate(conversion.model.named_modules())}
    return sorted(conversion.parts.values(), key=lambda part: order.get(part.path, len(order)))


def _graphs(part: Part) -> list[Graph]:
    return [graph for graphs in part.graphs.values() for graph in graphs]


def _capture_number(graph: Graph) -> int:
    return graph.gm.meta["amp"].get("capture", 0)


def user_path(part_path: str, module: str) -> str:
    """A graph's module path ("inner.up", "inner", or "" for its inputs' casts) as the user's model names it."""
    inside = "" if module in ("inner", "") else module.removeprefix("inner.")
    return ".".join(p for p in (part_path, inside) if p)


def _user_paths_in(part_path: str, text: str) -> str:
    """A note naming the graph's modules ("could not trace inner.model") in the user's paths."""
    return re.sub(r"\binner(\.[\w.]+)?\b", lambda match: user_path(part_path, match.group(0)) or "the model", text)


def merged_summary(conversion: InPlaceConversion, summaries: list[tuple[str, dict]]) -> dict:
    """What the report's opening lines read: the conversion's config, each graph's facts renamed, the parts."""
    config = conversion.config
    summary = {"level": config.level, "requested_level": config.requested_level, "dtype": config.low_dtype_name,
               "frontend": "in place (each part captured on its first calls)", "keep_io_types": config.keep_io_types,
               "loss_scale_manager": config.loss_scale_manager, "leaf_modules": [], "notes": [], "opaque": {},
               "hooks": {}, "training_reads": {}, "casts": 0, "pass_counts": {}, "in_place": True,
               "parts": parts_summary(conversion)}
    if not summaries:
        summary["notes"].append(NOT_CALLED)
    for path, graph_summary in summaries:
        summary.setdefault("devices", graph_summary.get("devices"))
        summary["leaf_modules"] += [user_path(path, leaf) for leaf in graph_summary.get("leaf_modules", ())]
        summary["notes"] += [f"{path or 'the model'}: {_user_paths_in(path, note)}" for note in graph_summary.get("notes", ())]
        summary["casts"] += graph_summary.get("casts", 0)
        add_calibration(summary["pass_counts"], graph_summary.get("pass_counts", {}).get("calibrate_ranges"))
        for name in ("opaque", "hooks", "training_reads"):
            summary[name].update({user_path(path, where): value
                                  for where, value in graph_summary.get(name, {}).items()})
    return summary


def parts_summary(conversion: InPlaceConversion) -> dict:
    """{path: {"status": "graph" | "as written" | "not called yet", "captures", "graphs", "reasons"}}."""
    return {part.path: {"status": part_status(part), "captures": part.captures, "graphs": len(_graphs(part)),
                        "reasons": list(dict.fromkeys(part.as_written.values()))}
            for part in ordered_parts(conversion)}


def part_status(part: Part) -> str:
    if _graphs(part):
        return GRAPH
    return AS_WRITTEN if part.as_written else NOT_CALLED_YET


# -- running the parts as written: compare()'s fp32 reference --------------------------------------------
@contextlib.contextmanager
def running_as_written(model: nn.Module):
    """Every part runs its own forward (no graph, no capture) inside the block; the parts are back after it."""
    conversion = in_place_conversion(model)   # None: a plain fp32 model, already as written
    parts = list(conversion.parts.values()) if conversion is not None else []
    converted = [(part.module, part.module.__dict__["forward"]) for part in parts]
    for part in parts:
        if part.own_forward is not None:
            part.module.__dict__["forward"] = part.own_forward
        else:
            part.module.__dict__.pop("forward", None)
    try:
        yield model
    finally:
        for module, forward in converted:
            module.__dict__["forward"] = forward


@contextlib.contextmanager
def graph_calls_hooked(conversion: InPlaceConversion, on_call):
    """on_call(part_path, gm, tensors) before each part graph runs (graphs captured so far)."""
    gms = [graph.gm for part in conversion.parts.values() for graph in _graphs(part)]
    handles = [gm.register_forward_pre_hook(lambda gm, tensors: on_call(gm.meta["amp"]["part"], gm, tensors))
               for gm in gms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- verify -------------------------------------------------------------------------------------------------
def verify_in_place(model: nn.Module, inputs: tuple, kwargs: dict) -> None:
    """One call captures what the inputs need; a second checks every graph on the tensors it receives."""
    from amp_compiler.insight.verify import DtypeMismatch, verify

    failures = []

    def check(path: str, gm, tensors):   # raised after the call: a part takes a graph's error for a shape guard
        if not failures:
            try:
                verify(gm, *tensors)
            except (DtypeMismatch, ValueError) as error:
                failures.append((path, error))

    with torch.no_grad():
        model(*inputs, **kwargs)
        with graph_calls_hooked(in_place_conversion(model), check):
            model(*inputs, **kwargs)
    if failures:
        path, error = failures[0]
        raise type(error)(f"part {path or '(the model)'}: {error}") from error


# -- compare ------------------------------------------------------------------------------------------------
def compare_in_place(model: nn.Module, converted: nn.Module, inputs: tuple, rtol: float | None):
    """Each part graph's nodes against their fp32 values, the outputs against the fp32 model.

    The reference is `model` run as written (the converted model itself when it is `model`): the tensors
    each part receives there feed the fp32 replay of that part's graph; the converted run feeds the graph as
    it is. So a node's error is what the converted model has accumulated up to it. Calls pair up by order."""
    from amp_compiler.insight import compare as cmp
    conversion = in_place_conversion(converted)
    low = conversion.config.low_dtype_name
    with cmp._eval_mode(model, converted), torch.no_grad():
        cmp._run_model(converted, inputs)   # captures what these inputs need: the runs below know every graph
        # the parts judged as one model: at fp8, FP8_RTOL when any part runs float8 matmuls (compare.default_rtol)
        graphs = [graph.gm for _, graph in shown_graphs(conversion)]
        rtol, rtol_from = (rtol, "") if rtol is not None else \
            cmp.default_rtol(*graphs) if graphs else (cmp.DEFAULT_RTOL.get(low, 1e-2), f"{low} default")
        with running_as_written(model):
            reference_calls, reference_out = _reference_run(model, conversion, inputs)
        graph_calls, candidate_out = _converted_run(converted, conversion, inputs)
    errors_by_call, notes = _call_errors(graph_calls, reference_calls, low, rtol)
    outputs = [cmp._node_error(None, c, r, low, rtol, name=f"output[{i}]")
               for i, (c, r) in enumerate(zip(cmp._leaves(candidate_out), cmp._leaves(reference_out)))]
    errors = [error for call in errors_by_call for error in call.values()]
    report = cmp.ComparisonReport(low, rtol, sorted(errors, key=cmp.badness, reverse=True), outputs, notes=notes,
                                  rtol_from=rtol_from)
    for call in errors_by_call:   # the first failing node: parts in call order, nodes in graph order
        first = next((node for node, error in call.items() if not error.ok), None)
        if first is not None:
            report.first_failure, report.chain = call[first], cmp._chain(first, call)
            break
    return report


def _reference_run(model: nn.Module, conversion: InPlaceConversion, inputs: tuple):
    """model(*inputs) with the tensors each graph-holding part's module receives, by part path."""
    from amp_compiler.insight.compare import _run_model
    calls: dict[str, list] = {}
    handles = []
    for part in conversion.parts.values():
        module = _submodule(model, part.path)
        if part.graphs and module is not None:
            handles.append(module.register_forward_pre_hook(
                lambda _, args, kwargs, path=part.path: calls.setdefault(path, []).append(_tensors(args, kwargs)),
                with_kwargs=True))
    try:
        return calls, _run_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()


def _converted_run(model: nn.Module, conversion: InPlaceConversion, inputs: tuple):
    """model(*inputs) with, by part path, one entry per call of the part: (gm, tensors) or None (as written)."""
    calls: dict[str, list] = {}

    def graph_ran(path, gm, tensors):
        calls[path][-1] = (gm, tuple(t.detach().clone() for t in tensors))

    handles = [part.module.register_forward_pre_hook(
        lambda *_, path=part.path: calls.setdefault(path, []).append(None)) for part in conversion.parts.values()]
    try:
        with graph_calls_hooked(conversion, graph_ran):
            return calls, model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def _call_errors(graph_calls: dict, reference_calls: dict, low: str, rtol: float) -> tuple[list[dict], list[str]]:
    """Per graph call, {node: NodeError} (module paths the user's); notes for calls without a reference."""
    from amp_compiler.insight import compare as cmp
    per_call, notes = [], []
    for path, calls in graph_calls.items():
        references = reference_calls.get(path, [])
        for index, call in enumerate(calls):
            if call is None:
                continue
            gm, tensors = call
            reference = references[index] if index < len(references) else None
            if reference is None or len(reference) != len(tensors):
                notes.append(f"{path or 'the model'}: call {index + 1} has no matching call in the fp32 run; "
                             "its nodes are not compared")
                continue
            low_values, _ = cmp._run(gm, tensors, fp32=False)
            fp32_values, _ = cmp._run(gm, reference, fp32=True, scales=cmp.fp8_scales(gm, low_values))   # fp8: its scales
            per_call.append({node: dataclasses.replace(cmp._node_error(node, low_values[node], fp32_values[node],
                                                                       low, rtol),
                                                       module=user_path(path, cmp.module_of(node)))
                             for node in gm.graph.nodes if node in fp32_values and node in low_values})
    return per_call, notes


def _tensors(args: tuple, kwargs: dict) -> tuple | None:
    try:
        return tuple(t.detach().clone() for t in call_key(args, kwargs)[1])
    except Uncapturable:
        return None


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:   # an fp32 reference model built otherwise: that part is not compared
        return None
