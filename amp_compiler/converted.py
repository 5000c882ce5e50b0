"""The one seam every tool reads a conversion through: its graphs, under the user's module paths.

    convert(model)                  -> a GraphModule                      -> [("", gm)]
    convert(model) (uncapturable)   -> the model run as written,           -> [("backbone", gm), ("head", gm)]
                                       its children converted
    convert(model, inplace=True),   -> the user's model, compiled on its   -> every graph dynamo made so far,
    amp_compiler.compile(model)        calls by TorchDynamo                   in the order it made them

explain, verify, compare, render, freeze and the integrations loop over `converted_graphs(model)`. A model
compiled on dynamo carries its record (`compiled_record`: dynamo/compile.py's CompiledForward or
CompiledChildren), which knows its graphs and reports on them with dynamo's own facts (graph breaks,
recompiles); this module names the attribute so that no tool imports the dynamo package to find it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.fx as fx
from torch import nn

from amp_compiler.frontend.training_reads import as_written_copy
from amp_compiler.saved_decisions import SAVED_ATTRIBUTE, graph_summary

COMPILED_ATTRIBUTE = "_amp_compiled"   # on the user's model: the record of its compiled forward


class ConvertedGraph(NamedTuple):
    prefix: str            # the module path the graph's own module paths are relative to ("" for the model)
    gm: fx.GraphModule


def compiled_record(model):
    """The record amp_compiler.compile (convert(inplace=True)) leaves on a model, or None."""
    return model.__dict__.get(COMPILED_ATTRIBUTE) if isinstance(model, nn.Module) else None


def is_converted(model) -> bool:
    """Whether `model` is a conversion: a GraphModule from convert() (or one torch.load brought back), a model run
    as written with converted children, or a model converted in place (before its first call too)."""
    return compiled_record(model) is not None or _carries_a_summary(model)


def _carries_a_summary(model) -> bool:
    """convert()'s record in the module's own __dict__ (not an attribute a wrapper forwards to the model it holds)."""
    return isinstance(model, nn.Module) and ("amp" in (model.__dict__.get("meta") or {})
                                             or SAVED_ATTRIBUTE in model.__dict__)


def converted_graphs(model) -> list[ConvertedGraph]:
    """Every converted graph of `model`, with the module path it sits at; [] for a module that is no conversion.
    A model run as written gives the children of the copy its current train/eval flags run (training_reads.py)."""
    record = compiled_record(model)
    if record is not None:
        return [ConvertedGraph(prefix, gm) for prefix, gm, _ in record.graphs(model)]
    if not _carries_a_summary(model):
        return []
    summary = graph_summary(model)   # put back from the saved copy after torch.save / torch.load
    if "children" in summary:
        runs = as_written_copy(model) or model
        return [ConvertedGraph(name, runs.get_submodule(name)) for name in summary["children"]]
    return [ConvertedGraph("", model)]
