"""calibration_data on TorchDynamo's capture: each graph calibrated on the tensors it receives when the samples run.

    convert(model, "O1", inplace=True, calibration_data=[(x1,), (x2,)])

Dynamo hands the backend one graph at a time, with fake inputs: the values a graph computes on the samples exist
only while the model runs them. So the conversion runs every sample through the model (no grad, the model's own
train/eval flags, buffers restored after), and while it does the backend keeps each new graph as captured, runs it
as captured (fp32, as the model computes) and records the tensors each of its calls received. When the samples
are done, each such graph is converted with those calls as its calibration samples (the ranges decide: passes/
painting/calibrate_ranges.py). A graph dynamo makes later (training flags, grad mode, new shapes) is calibrated on
the recorded calls of its frame whose inputs fit it (same placeholder names; static sizes equal; a symbolic size
read off the tensor that has it): the calls of a recompiled frame have the inputs the earlier graph had. A graph
of a frame no sample reached (a graph break that only training takes, say) is converted uncalibrated, and
explain() says so: give samples in the mode the model will run in.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.painting.calibrate_ranges import check_calibration_data, progress


class GraphCalls:
    """The tensors each graph received while the calibration samples ran, by frame and placeholder name."""

    def __init__(self):
        self.recording = False
        self.calls: list[tuple[str, dict]] = []      # (frame, {placeholder name: value}) per graph call
        self.pending: list[CalibratingGraph] = []    # graphs made while recording, converted when it ends
        self.uncalibrated: list[str] = []            # why a graph made later got no samples (explain's notes)

    def keep(self, gm: fx.GraphModule, as_captured: fx.GraphModule, convert: Callable) -> "CalibratingGraph":
        graph = CalibratingGraph(self, gm, as_captured, convert)
        self.pending.append(graph)
        return graph

    def finish(self) -> None:
        """Convert every graph kept while recording, on the calls recorded for it and its frame."""
        self.recording = False
        pending, self.pending = self.pending, []
        for graph in pending:
            graph.converted = graph.convert(graph.gm, self.samples_for(graph.gm))
            graph.as_captured = None

    def samples_for(self, gm: fx.GraphModule) -> list[tuple]:
        """The recorded calls of gm's frame whose values fit gm's placeholders, as tuples in placeholder order (a
        symbolic size's placeholder, which a static graph's calls lack, read off the tensor that has that size)."""
        frame = frame_of(gm)
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        samples = []
        for call_frame, values in self.calls:
            if call_frame != frame:
                continue
            sample = tuple(values[node.name] if node.name in values else _size_from(node, placeholders, values)
                           for node in placeholders)
            if all(_fits(value, _fake(node)) for value, node in zip(sample, placeholders)):
                samples.append(sample)
        return samples


def run_samples(model: nn.Module, calls: GraphCalls, samples: Iterable, undone) -> None:
    """Each sample through the compiled `model` while `calls` records, then the graphs made converted on them.
    `undone`: the context that puts the model's buffers and histories back after (effects.undone_effects)."""
    check_calibration_data(samples)
    calls.recording = True
    try:
        with undone, torch.no_grad():
            for index, sample in enumerate(progress(samples)):
                inputs = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
                try:
                    model(*inputs)
                except Exception as error:  # noqa: BLE001 - the sample is named
                    raise ValueError(f"calibration_data sample {index}: the model fails on it: "
                                     f"{type(error).__name__}: {error}") from error
        if not calls.calls:
            raise ValueError("calibration_data gave no samples: pass an iterable of input tuples, like example_inputs")
    finally:
        calls.finish()


class CalibratingGraph:
    """What the backend returns for a graph made while the samples run: the graph as captured, its calls recorded;
    once converted (GraphCalls.finish), the converted graph."""

    def __init__(self, calls: GraphCalls, gm: fx.GraphModule, as_captured: fx.GraphModule, convert: Callable):
        self.calls, self.gm, self.as_captured, self.convert = calls, gm, as_captured, convert
        self.converted: Callable | None = None

    def __call__(self, *args):
        if self.converted is not None:
            return self.converted(*args)
        placeholders = [node.name for node in self.gm.graph.nodes if node.op == "placeholder"]
        self.calls.calls.append((frame_of(self.gm), {name: _kept(value) for name, value in zip(placeholders, args)}))
        return self.as_captured(*args)


FRAME = "amp_frame"   # gm.meta: the code a dynamo graph was made for (note_frame)


def note_frame(gm: fx.GraphModule) -> None:
    """Write on a graph dynamo hands the backend the code it is tracing, by file, name and line: the same for a
    deepcopy's frames (its own copy of the compiled function), unlike the compile id's frame number."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        code = InstructionTranslator.current_tx().f_code
        gm.meta[FRAME] = f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"
    except Exception:  # noqa: BLE001 - dynamo internals moved: the compile id's frame number (one model only)
        gm.meta[FRAME] = str(gm.meta.get("dynamo_compile_id", "")).partition("/")[0]


def frame_of(gm: fx.GraphModule) -> str:
    return gm.meta.get(FRAME, "")


def _fake(node: fx.Node):
    """A placeholder's fake value: dynamo's example_value (meta["val"] once prepare_graph copied it)."""
    return node.meta.get("val", node.meta.get("example_value"))


def _size_from(node: fx.Node, placeholders: list, values: dict):
    """A symbolic size's value in a recorded call: the size of a recorded tensor at the dim that has that symbol
    (None when no recorded tensor has it: the call does not fit)."""
    symbol = str(_fake(node))
    for other in placeholders:
        fake, value = _fake(other), values.get(other.name)
        if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) and value.dim() == fake.dim():
            for dim, size in enumerate(fake.shape):
                if not isinstance(size, int) and str(size) == symbol:
                    return value.shape[dim]
    return None


def _kept(value):
    """A call's tensor as it was (a parameter by reference: it is the weight itself), the rest as given."""
    if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone()


def _fits(value, fake) -> bool:
    """A recorded value can stand for a placeholder whose fake value is `fake`: a tensor of its dtype and rank with
    its static sizes, or a number for a number (a symbolic size)."""
    if isinstance(fake, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.dtype == fake.dtype and value.dim() == fake.dim() and all(
            not isinstance(size, int) or size == actual for size, actual in zip(fake.shape, value.shape))
    return value is not None and not isinstance(value, torch.Tensor)
