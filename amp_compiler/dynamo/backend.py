"""amp_backend(config): a torch.compile backend that runs the project's fx pipeline on each graph dynamo captures.

Dynamo calls the backend once per graph (graph breaks give several, recompiles more); the graph is rewritten in
place (it is ours: dynamo hands over a fresh GraphModule and guards on the model and the inputs, never on it) and
run as fx code, or handed to inductor in the same compilation. Nothing dynamo guards on is touched: no example input
is run, no module attribute is set (the list of graphs lives in a table keyed by the model, graphs()).
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.config import AmpConfig
from amp_compiler.graph_conversion import collector_paused, compile_graph
from amp_compiler.dynamo.cache_state import mark_cache_state
from amp_compiler.dynamo.calibration import GraphCalls, note_frame
from amp_compiler.dynamo.bodies import call_bodies_directly, convert_bodies
from amp_compiler.dynamo.graph_inputs import frame_prefixes, parameter_names, prepare_graph, user_path
from amp_compiler.dynamo.weight_cache import cache_weight_casts
from amp_compiler.frozen import FrozenWeights
from amp_compiler.frontend import CapturedGraph
from amp_compiler.passes.policy.numerics import dtype_name

FRONTEND = "torch.dynamo"
BACKENDS = ("eager", "inductor")
_GRAPHS: "weakref.WeakKeyDictionary[object, list[fx.GraphModule]]" = weakref.WeakKeyDictionary()


def amp_backend(config: AmpConfig, *, backend: str = "eager", model: nn.Module | None = None,
                weight_cache: bool = True, calibration: GraphCalls | None = None, histories=None) -> Callable:
    """A dynamo backend `(gm, example_inputs) -> callable`: the graph converted by `config`'s level, run as fx code
    (backend="eager") or compiled by inductor (backend="inductor"). `model`: the compiled model, when known; its
    parameters name the graph's weight inputs and graphs(model) lists what was converted. `weight_cache`
    (eager): inference calls reuse each weight's low copy while the weight is unchanged (weight_cache.py).
    `calibration`: the graph calls the calibration samples made (calibration.py): graphs made while they run
    are converted once they are done, each on its own calls; later ones on their frame's calls that fit.
    `histories` (fp8 delayed scaling): the Fp8HistoryStore every graph's amax histories are bound to."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    # dynamo's code cache keeps the backend alive until torch._dynamo.reset(): a weak reference lets the model go
    model_ref = weakref.ref(model) if model is not None else lambda: None

    def convert_graph(gm: fx.GraphModule, example_inputs) -> Callable:
        reason = getattr(gm, "compile_subgraph_reason", None)   # dynamo's: why the graph ended where it did

        def converted_or_fallback(gm: fx.GraphModule, samples: list | None) -> Callable:
            as_captured = _graph_copy(gm)   # the passes edit gm itself: what runs if they fail
            try:
                return _converted(gm, example_inputs, reason, samples)
            except Exception as error:  # noqa: BLE001 - any failure of the passes: the graph still runs, said once
                fallback = under_autocast(as_captured, config, example_inputs, error)
                convert_graph.fallbacks.append(fallback.reason)
                return fallback

        if calibration is None:
            return converted_or_fallback(gm, None)
        note_frame(gm)   # which recorded calls are this graph's
        if calibration.recording:   # the samples are running: converted on their calls once they are done
            return calibration.keep(gm, _graph_copy(gm), converted_or_fallback)
        samples = calibration.samples_for(gm)
        if not samples:
            calibration.uncalibrated.append(f"graph of {', '.join(_modules_of(gm)[:3]) or 'the model'} (compile id "
                                            f"{gm.meta.get('dynamo_compile_id', '?')}): no calibration sample's call "
                                            "fits its inputs, converted uncalibrated")
        return converted_or_fallback(gm, samples or None)

    def _converted(gm: fx.GraphModule, example_inputs, reason, samples: list | None) -> Callable:
        model = model_ref()
        converted = convert_captured_graph(gm, example_inputs, config, model, calibration_data=samples)
        compile_id = str(gm.meta.get("dynamo_compile_id", ""))
        converted.meta["amp"]["dynamo"] = {"compile_id": compile_id,
                                           "graph_break": _where(reason) if getattr(reason, "graph_break", False)
                                           else None}
        _warn_at_the_recompile_limit(compile_id, model)
        if histories is not None:   # before the cache: cached fp8 weights follow the histories
            _record_in_training_only(converted, model)
            histories.bind(converted)
        if convert_graph.caches_weights:
            cache_weight_casts(converted, convert_graph.weight_cache)
        compiled = converted
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            compiled = compile_fx(converted, list(example_inputs))
        if model is not None:   # listed once nothing can fail: a graph that fell back is no converted graph
            _GRAPHS.setdefault(model, []).append(converted)
        convert_graph.graphs.append(converted)
        for watcher in list(convert_graph.watchers):   # e.g. an overflow replay checking every graph it runs
            watcher(converted)
        return compiled

    def made_a_graph() -> bool:
        """Whether dynamo handed this backend a graph yet (converted, fallen back, or waiting on calibration)."""
        return bool(convert_graph.graphs or convert_graph.fallbacks or (calibration and calibration.pending))

    convert_graph.graphs = []   # every graph this backend converted (graphs(model) when the model is known)
    convert_graph.fallbacks = []   # why each graph the passes failed on runs under autocast instead
    convert_graph.weight_cache = FrozenWeights().eval()   # the low weight copies all its graphs read
    convert_graph.caches_weights = weight_cache and backend == "eager"
    convert_graph.calibration = calibration
    convert_graph.watchers = []   # callables told of each graph made, before it first runs
    convert_graph.made_a_graph = made_a_graph
    return convert_graph


def convert_captured_graph(gm: fx.GraphModule, example_inputs, config: AmpConfig,
                           model: nn.Module | None = None, calibration_data: list | None = None) -> fx.GraphModule:
    """FX_PIPELINE on dynamo's graph itself (no re-trace, no copy); the decisions stay in its meta["amp"].
    `calibration_data`: real inputs of this graph (calibration.py), whose ranges decide too."""
    started = time.perf_counter()
    # before the passes: keep_io_types leaves these low; not an encoder-decoder's: its cross-attention cache is
    # read as stored by the next step's fp32 code (T5: matmul(fp32 query, bf16 key) failed in dynamo's trace)
    cache_tensors = 0 if _encoder_decoder(model) else mark_cache_state(gm)
    converted = _convert(gm, parameter_names(gm, example_inputs, model), config, tuple(example_inputs),
                         calibration_data)
    converted.meta["amp"]["cache_tensors_low"] = cache_tensors
    converted.meta["amp"]["conversion_s"] = time.perf_counter() - started
    return converted


def _encoder_decoder(model: nn.Module | None) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _convert(gm: fx.GraphModule, names: dict, config: AmpConfig, example_inputs: tuple | None = None,
             calibration_data: list | None = None):
    """One graph and the bodies it calls (bodies.py), each converted in place. A body's example inputs are its
    placeholders' fake values (dynamo recorded them); bodies are not calibrated (their inputs are the graph's
    values inside it)."""
    prepare_graph(gm, frame_prefixes(names))
    converted_bodies = convert_bodies(gm, names, config, lambda body, body_names, body_config: _convert(
        body, body_names, body_config,
        tuple(n.meta.get("val") for n in body.graph.nodes if n.op == "placeholder")))
    captured = CapturedGraph(gm, FRONTEND, model=gm, example_inputs=example_inputs)
    with collector_paused():
        converted = compile_graph(captured, config, calibration_data, follow_flags=False, spend_capture=True)
    call_bodies_directly(converted)
    converted.meta["amp"].update({"graph_inputs": names, "bodies": converted_bodies,
                                  "nodes_captured": sum(1 for _ in converted.graph.nodes)})
    return converted


def _record_in_training_only(gm: fx.GraphModule, model: nn.Module | None) -> None:
    """A graph's amax histories record when it was made for training: dynamo guards on the model's `training`, so
    the flag at capture is the graph's (an eval graph reads what training recorded)."""
    training = model.training if model is not None else True
    for name, module in gm.named_modules():
        if name.startswith("fp8_history."):
            module.train(training)


def graphs(model) -> list[fx.GraphModule]:
    """The converted graphs of a model compiled by amp_compiler.compile, in the order dynamo made them (each one
    takes amp_compiler.explain)."""
    return list(_GRAPHS.get(model, ()))


def forget_graphs(model) -> None:
    """graphs(model) empty again (amp_compiler.restore)."""
    _GRAPHS.pop(model, None)


def _where(reason) -> str:
    """dynamo's graph-break reason with the user's line it broke at."""
    stack = getattr(reason, "user_stack", None) or []
    frame = stack[-1] if stack else None
    at = f" (at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name})" if frame is not None else ""
    return f"{reason.reason}{at}"


RECOMPILE_LIMIT = 64   # graphs per frame of a compiled model (dynamo's default: 8, then the frame runs as written)


class RecompileLimitWarning(UserWarning):
    """A frame of a compiled model made its last graph: a new call form of it will run as written (fp32)."""


def _warn_at_the_recompile_limit(compile_id: str, model) -> None:
    """compile ids are "frame/attempt": attempt RECOMPILE_LIMIT - 1 is the last graph dynamo makes for the frame."""
    attempt = compile_id.rsplit("/", 1)[-1]
    if attempt.isdigit() and int(attempt) + 1 >= RECOMPILE_LIMIT:
        warnings.warn(f"amp_compiler: a frame of {type(model).__name__ if model is not None else 'the model'} has "
                      f"been compiled {int(attempt) + 1} times (shapes, flags or Python arguments that change from "
                      "call to call): TorchDynamo runs a new call form of it as written from now on, in fp32. Pass "
                      "changing Python values as tensors, or mark dims dynamic (torch._dynamo.mark_dynamic)",
                      RecompileLimitWarning, stacklevel=2)


class ConversionFallbackWarning(UserWarning):
    """A graph dynamo captured could not be converted: it runs under torch.autocast instead."""


class under_autocast:
    """A dynamo graph the passes failed on, run as captured inside torch.autocast(level's dtype): autocast's own
    op lists decide (matmuls low, softmax, norms and losses fp32), so the graph is still mixed precision and runs."""

    def __init__(self, gm: fx.GraphModule, config: AmpConfig, example_inputs, error: Exception):
        self.gm, self.config = gm, config
        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
        self.device = "cuda" if "cuda" in devices else "cpu"
        modules = _modules_of(gm)
        where = f"the graph of {', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''}" if modules \
            else "a graph"
        dtype = config.low_dtype if config.level_spec.paints else None
        self.reason = (f"{where} could not be converted ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                       f"it runs under torch.autocast({self.device}, {dtype_name(dtype)})")
        warnings.warn(f"amp_compiler: {self.reason}", ConversionFallbackWarning, stacklevel=2)

    def __call__(self, *args):
        with level_autocast(self.config, self.device):
            return self.gm(*args)


def level_autocast(config: AmpConfig, device: str):
    """torch.autocast with the level's low dtype on `device`, what every fallback runs under (O0: nothing)."""
    if not config.level_spec.paints:
        return contextlib.nullcontext()
    return torch.autocast(device, config.low_dtype)


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as dynamo captured it, on the same root (node metadata shared, not copied); the bodies it calls
    (checkpoint's, which the passes convert in place) copied too."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    copied = fx.GraphModule(gm, graph)
    for node in copied.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(copied, node.target, None), fx.GraphModule):
            setattr(copied, node.target, _graph_copy(getattr(copied, node.target)))
    return copied


def _modules_of(gm: fx.GraphModule) -> list[str]:
    """The user's module paths a dynamo graph runs, outermost first."""
    paths = {}
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            paths.setdefault(user_path(path), None)
    return [path for path in paths if path]
