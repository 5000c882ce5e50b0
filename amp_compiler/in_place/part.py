"""One module converted in place: its `forward` (an instance attribute, the class is untouched) finds the
graph captured for calls like this one, or captures it now, or runs the module as written.

    part(*args, **kwargs)
      call_key -> a graph for this key whose watched train()/eval() flags and ModuleState (guards.py: the
                  attributes, children and hooks its capture saw) still hold -> run it
               -> none -> capture the module on these inputs (capture + compile_graph, as convert() does)
                  -> something runs low: keep the graph          -> nothing runs low: as written (no cost)
                  -> an argument cannot be captured (a KV cache), the capture fails or leaves a module with
                     parameters untraced, the forward does what a graph cannot (self.x = ..., no_grad), or
                     the part has been captured CAPTURE_LIMIT times: as written, its children become parts
A graph that raises on a call the module as written accepts assumed something about shapes: the part keys
its calls by shape from then on and captures again (within the same limit). At O0 nothing is captured.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from amp_compiler.in_place.call_key import Uncapturable, call_key, fill, template
from amp_compiler.passes.node_facts import facts

CAPTURE_LIMIT = 8   # captures per part; then it runs as written (a warning names it)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)   # never called themselves


class CaptureLimitWarning(UserWarning):
    """A part of an in-place converted model was captured CAPTURE_LIMIT times and now runs as written."""


@dataclass
class Graph:
    gm: torch.fx.GraphModule
    watched: list          # (user's module, flag) for every module whose `training` the capture read
    low: int               # nodes that run low
    state: object = None   # guards.ModuleState: the part's attributes, children and hooks the capture saw


@dataclass
class Part:
    module: nn.Module
    path: str                               # "" is the model itself
    conversion: object                      # the InPlaceConversion it belongs to
    own_forward: object = None              # an instance forward the module had before: restore() puts it back
    graphs: dict = field(default_factory=dict)       # call key -> [Graph]
    as_written: dict = field(default_factory=dict)   # call key -> why it runs as written
    captures: int = 0
    keyed_by_shape: bool = False
    children_are_parts: bool = False
    warned: bool = False

    @property
    def name(self) -> str:
        return self.path or type(self.module).__name__

    def original(self):
        if self.own_forward is not None:
            return self.own_forward
        forward = type(self.module).forward
        if torch.compiler.is_compiling():   # dynamo reads forward.__get__(module) as module.forward: the part again
            return functools.partial(forward, self.module)
        return forward.__get__(self.module)

    def __getstate__(self):
        # torch.save(model) keeps the conversion's choices, not its graphs: the loaded model captures again
        return {**self.__dict__, "graphs": {}, "as_written": {}, "captures": 0, "warned": False}

    # -- a call ----------------------------------------------------------------------------------------
    def call(self, args: tuple, kwargs: dict):
        conversion = self.conversion
        if conversion.calling:   # nested in a call of the model (or of another part)
            return self._call(args, kwargs)
        conversion.calling = True
        try:
            conversion.before_outermost_call()   # once per model call: frozen copies' values checked together
            return self._call(args, kwargs)
        finally:
            conversion.calling = False

    def _call(self, args: tuple, kwargs: dict):
        try:
            key, tensors = call_key(args, kwargs)
        except Uncapturable as kind:
            return self._as_written(("uncapturable", str(kind)), f"called with a {kind} argument (not a tensor "
                                    "or a constant: no graph can take it)", args, kwargs)
        key = (self.module.training, *key)
        if self.keyed_by_shape:
            key += tuple(tuple(t.shape) for t in tensors)
        for graph in self.graphs.get(key, ()):
            if all(module.training is flag for module, flag in graph.watched) and \
                    (graph.state is None or graph.state.holds()):
                return self._run_graph(graph, key, tensors, args, kwargs)
        if key in self.as_written:
            return self.original()(*args, **kwargs)
        return self._capture_and_run(key, tensors, args, kwargs)

    def _run_graph(self, graph: Graph, key, tensors, args, kwargs):
        try:
            return graph.gm(*tensors)
        except Exception:
            result = self.original()(*args, **kwargs)   # the user's own error raises here, graph kept
        # the module as written takes this call: the graph assumed something about shapes
        self.graphs[key].remove(graph)
        if not self.graphs[key]:
            del self.graphs[key]
        self.keyed_by_shape = True
        return result

    def _as_written(self, key, reason: str, args, kwargs, children: bool = True):
        if key not in self.as_written:
            self._record_as_written(key, reason, children)
        return self.original()(*args, **kwargs)

    @torch.compiler.disable   # makes parts (instance forwards): eager under torch.compile, a break on this call only
    def _record_as_written(self, key, reason: str, children: bool = True):
        self.as_written[key] = reason
        if children:
            self.children_become_parts()

    def children_become_parts(self):
        if self.children_are_parts:
            return
        self.children_are_parts = True
        pending = list(self.module.named_children())
        while pending:
            name, child = pending.pop(0)
            if isinstance(child, _CONTAINERS):   # the parent calls their items: those are the parts
                pending += [(f"{name}.{n}", c) for n, c in child.named_children()]
            elif any(True for _ in child.parameters()):   # parameterless children hold nothing to cast
                self.conversion.add_part(child, f"{self.path}.{name}" if self.path else name)

    # Under torch.compile a capture (fx tracing, compile_graph) runs eagerly: dynamo breaks the graph on the
    # call that captures only; the calls after it find the graph and trace through it (no break).
    @torch.compiler.disable
    def _capture_and_run(self, key, tensors, args, kwargs):
        if not self.conversion.config.level_spec.paints:   # O0: nothing would run low, nothing to capture
            return self._as_written(key, f"{self.conversion.config.level}: nothing runs low", args, kwargs,
                                    children=False)
        if self.captures >= CAPTURE_LIMIT:
            reason = f"captured {CAPTURE_LIMIT} times already (calls differ in {self._differences()})"
            if not self.warned:
                self.warned = True
                warnings.warn(f"amp_compiler: {self.name} of the in-place converted model runs as written from now "
                              f"on: {reason}. Its children are converted as parts of their own.",
                              CaptureLimitWarning, stacklevel=4)
            return self._as_written(key, reason, args, kwargs)
        self.captures += 1
        try:
            graph = self.conversion.capture(self, args, kwargs, tensors)
        except Exception as error:  # noqa: BLE001 - any capture failure: as written, children tried instead
            self.conversion.warn_if_made_low(self.module)   # model.half() after converting: every capture refuses
            first_line = (str(error).splitlines() or [""])[0][:200]
            return self._as_written(key, f"not captured: {type(error).__name__}: {first_line}", args, kwargs)
        if graph.low == 0:   # children it traced into have nothing low either; opaque ones are tried as parts
            return self._as_written(key, "nothing in it runs low at this level (runs as written, no cast)", args,
                                    kwargs, children=bool(graph.gm.meta["amp"]["opaque"]))
        try:   # on the very call it was captured on, a failure is no shape assumption: the graph is broken
            result = graph.gm(*tensors)
        except Exception as error:  # noqa: BLE001 - as written, children tried instead (recapturing would repeat it)
            first_line = (str(error).splitlines() or [""])[0][:200]
            return self._as_written(key, f"its graph fails on the call it was captured on: {type(error).__name__}: "
                                    f"{first_line}", args, kwargs)
        self.graphs.setdefault(key, []).append(graph)
        return result

    def _differences(self) -> str:
        keys = list(self.graphs) + list(self.as_written)
        lengths = {len(k) for k in keys}
        return "argument shapes or constants" if len(lengths) == 1 else "the arguments passed"


class PartForward:
    """The instance attribute `forward` of a part: same signature as the module's own forward."""
    _amp_part_forward = True   # module_tree.share_module_tree drops it from copies (captures trace the original)
    __name__ = "forward"

    def __init__(self, part: Part):
        self.part = part

    def __call__(self, *args, **kwargs):
        return self.part.call(args, kwargs)

    @property
    def __signature__(self):   # Hugging Face's generate() reads the forward's parameters
        return inspect.signature(self.part.original())

    @property
    def __doc__(self):
        return self.part.original().__doc__

    # Code that rewraps a bound forward (Accelerate: MethodType(wrapper(model.forward.__func__), model)) still
    # reaches the part through these.
    @property
    def __self__(self):
        return self.part.module

    @property
    def __func__(self):
        part = self.part
        return lambda module, *args, **kwargs: part.call(args, kwargs)

    def __repr__(self):
        return f"<in-place converted forward of {self.part.name}>"


def low_node_count(gm) -> int:
    return sum(1 for node in gm.graph.nodes if facts(node).get("precision") == "low")


class BoundCall(nn.Module):
    """What a part's capture traces: the module called the way this call called it, tensors as inputs."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.inner = module
        self.call_template = template(args, kwargs)


def bound_call(module: nn.Module, args: tuple, kwargs: dict, count: int) -> BoundCall:
    names = ", ".join(f"input_{i}" for i in range(count))
    tensors = f"({names}{',' if count == 1 else ''})"
    source = (f"def forward(self{', ' if count else ''}{names}):\n"
              f"    args, kwargs = self.call_template\n"
              f"    return self.inner(*fill(args, {tensors}), **fill(kwargs, {tensors}))\n")
    namespace = {"fill": fill}
    exec(compile(source, f"<in-place call of {type(module).__name__}>", "exec"), namespace)   # noqa: S102
    cls = type(f"{type(module).__name__}Call", (BoundCall,), {"forward": namespace["forward"]})
    wrapper = cls(module, args, kwargs)
    wrapper.training = module.training   # the GraphModule takes the root's flag for its whole tree
    return wrapper
