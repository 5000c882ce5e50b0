"""`self.training` read while capturing: the converted module captures each mode it is called in.

fx and torch.export run every traced module's forward once, in the mode the model is in, so a Python
`if self.training:` or `F.dropout(x, p, training=self.training)` is decided at capture. While capturing,
each traced module answers `training` through a recording property (leaves kept as calls follow
train()/eval() themselves and are not recorded). A converted module that read a flag checks, on every
call, that its modules still have the flags it read; when they do not, it converts the model again with
the flags it has now, keeps both graphs and switches between them (gm.graph, gm.code and explain() show
the graph of the current mode).

A mode the model cannot be captured in (`if self.training: if not torch.isfinite(h).all(): ...`, a layerdrop
drawing torch.rand) runs as convert() runs such a model: as written, its children converted (convert_children).
Its "graph" is one call of that copy (`run_as_written(self._amp_as_written, args, kwargs)`), and one warning
names the model and the reason. Converting the children needs example inputs: convert()'s, else the first call
in that mode brings them (a train() that meets the failure leaves the switch to that call).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.frontend.errors import TracingError
from amp_compiler.frontend.fx_capture import saved_with_output_type
from amp_compiler.frontend.module_tree import share_module_tree, unwrap_compiled
from amp_compiler.saved_decisions import SAVED_ATTRIBUTE

READS = "_amp_training_reads"   # {module path: the training flag it read at capture}
AS_WRITTEN = "_amp_as_written"   # on gm, in a mode that runs as written: the holder of that copy


@contextlib.contextmanager
def training_reads_recorded(root: nn.Module, skip: Callable[[nn.Module], bool]) -> Iterator[list]:
    """Yields the list of (module, flag) reads of `training` made by root's modules (but `skip`'s)."""
    reads: list = []
    classes: dict[type, type] = {}
    swapped = []
    for module in root.modules():
        if skip(module) or isinstance(module, torch.jit.ScriptModule):
            continue
        cls = type(module)
        if any("training" in vars(base) for base in cls.__mro__):   # already a descriptor of its own
            continue
        try:
            if cls not in classes:
                classes[cls] = _recording_class(cls, reads)
            module.__class__ = classes[cls]
        except Exception:  # noqa: BLE001 - a class that cannot be subclassed or swapped: its reads go unrecorded
            continue
        swapped.append((module, cls))
    try:
        yield reads
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _recording_class(cls: type, reads: list) -> type:
    # A data descriptor on the class wins over the instance's own `training` entry.
    def read(self):
        value = self.__dict__["training"]
        reads.append((self, value))
        return value

    def write(self, value):
        self.__dict__["training"] = value

    namespace = {"training": property(read, write), "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    with _init_subclass_skipped(cls):   # a user's registry must not record this capture-time class
        return type(cls)(cls.__name__, (cls,), namespace)


@contextlib.contextmanager
def _init_subclass_skipped(cls: type) -> Iterator[None]:
    # type() calls the base classes' __init_subclass__ (class registries; transformers wraps forward there);
    # cls's own attribute shadows its bases' for the moment the subclass is made, then is put back.
    own = cls.__dict__.get("__init_subclass__")
    cls.__init_subclass__ = classmethod(lambda subclass, **kwargs: None)
    try:
        yield
    finally:
        if own is None:
            del cls.__init_subclass__
        else:
            cls.__init_subclass__ = own


def read_flags(root: nn.Module, reads: list) -> dict[str, bool]:
    """{module path: flag read}, in reading order ("" is the root)."""
    paths = {id(module): name for name, module in root.named_modules()}
    return {paths[id(module)]: value for module, value in reads if id(module) in paths}


def follow_training_flags(gm: fx.GraphModule, model: nn.Module, convert_again: Callable[[nn.Module], fx.GraphModule]):
    """Let `gm` (captured from `model`, having read gm.__dict__[READS]) capture the model again when it is
    called with other flags. `convert_again(copy)` converts a copy of the model's tree set to those flags."""
    cls = type(gm)   # GraphModule gives every instance a class of its own: this changes `gm` alone
    model = unwrap_compiled(model)[0]
    cls._amp_model, cls._amp_convert_again = model, convert_again
    cls._amp_graphs = [_snapshot(gm, gm, model)]
    cls._amp_watched = _watched(gm)
    cls._call_impl = _call_in_captured_flags
    cls.train = _train_switching_graphs   # switches outside torch.compile'd calls too
    cls.__deepcopy__ = _deepcopy_following_flags
    cls.__reduce__ = _reduce_refusing_other_flags


def _watched(gm: fx.GraphModule) -> list[tuple[nn.Module, bool]]:
    return [(gm.get_submodule(path), flag) for path, flag in gm.__dict__[READS].items()]


def _call_in_captured_flags(self, *args, **kwargs):
    if any(module.training is not flag for module, flag in type(self)._amp_watched):
        _switch_graph(self, (args, kwargs))
    return nn.Module._call_impl(self, *args, **kwargs)


def _train_switching_graphs(self, mode: bool = True):
    nn.Module.train(self, mode)
    if any(module.training is not flag for module, flag in type(self)._amp_watched):
        _switch_graph(self)
    return self


def _deepcopy_following_flags(self, memo):
    copy = fx.GraphModule.__deepcopy__(self, memo)   # keeps the graph and meta, not other attributes
    copy.__dict__[READS] = dict(self.__dict__[READS])
    follow_training_flags(copy, type(self)._amp_model, type(self)._amp_convert_again)
    return copy


def _reduce_refusing_other_flags(self):
    # torch.save keeps the generated code of the current mode only, and no model to capture the other from:
    # the loaded module refuses a call with other flags instead of running this mode's graph silently.
    rebuild, arguments = saved_with_output_type(self)   # fx's, keeping the model's output container
    return _loaded_refusing_other_flags, (rebuild, arguments)


def _loaded_refusing_other_flags(rebuild, arguments) -> fx.GraphModule:
    gm = rebuild(*arguments)
    if gm.__dict__.get(READS):
        cls = type(gm)
        cls._amp_watched = _watched(gm)
        cls._call_impl = _refuse_other_flags
    return gm


def _refuse_other_flags(self, *args, **kwargs):
    for path, flag in self.__dict__[READS].items():
        if self.get_submodule(path).training is not flag:
            where = f"model.{path}" if path else "the model"
            raise RuntimeError(
                f"{where} read self.training ({flag}) when this graph was captured, and it is {not flag} now: a "
                f"converted module loaded from a file keeps only its {'train' if flag else 'eval'}-mode graph.\n"
                "Call it in that mode, or convert the model again (the live converted module captures both modes).")
    return nn.Module._call_impl(self, *args, **kwargs)


@torch._dynamo.disable   # capturing runs eagerly, also inside torch.compile
def _switch_graph(gm: fx.GraphModule, call: tuple | None = None) -> None:
    """Switch gm to the graph of its modules' flags now, converting the model in them if new. `call`: the
    (args, kwargs) of the call that met the new flags (None from train()/eval())."""
    cls = type(gm)
    # The current graph as it is now (freeze() may have added its weight copies since it was captured).
    cls._amp_graphs = [s for s in cls._amp_graphs if s["graph"] is not gm.graph] + [_snapshot(gm, gm, cls._amp_model)]
    flags = {name: module.training for name, module in gm.named_modules()}
    for snapshot in cls._amp_graphs:
        if all(flags.get(path) is flag for path, flag in snapshot["reads"].items()):
            break
    else:
        snapshot = _converted_in(cls, gm, flags, call)
        if snapshot is None:   # uncapturable and no inputs yet to convert its children with: the call will
            return
        cls._amp_graphs.append(snapshot)
    for name, value in snapshot["attributes"].items():
        setattr(gm, name, value)
    gm.graph = snapshot["graph"]   # recompiles: gm.code is this mode's
    gm.meta["amp"] = snapshot["summary"]
    if snapshot["saved"] is not None:
        setattr(gm, SAVED_ATTRIBUTE, snapshot["saved"])
    gm.__dict__[READS] = snapshot["reads"]
    cls._amp_watched = _watched(gm)


def _converted_in(cls, gm: fx.GraphModule, flags: dict[str, bool], call: tuple | None) -> dict | None:
    """The snapshot of the model converted in `flags`: a graph, or (uncapturable in them) the model as written
    with its children converted, converted with the call's inputs when convert() had none; None when there is
    no call yet to take them from."""
    key = tuple(sorted(flags.items()))
    copy = share_module_tree(cls._amp_model)
    for name, module in copy.named_modules():
        module.training = flags.get(name, module.training)
    failed = getattr(cls, "_amp_uncapturable", {})
    with torch.inference_mode(False), torch.enable_grad():
        try:
            if key in failed:
                raise failed[key]
            converted = cls._amp_convert_again(copy)
        except TracingError as error:
            if call is None:
                cls._amp_uncapturable = {**failed, key: error}   # the call retries with its inputs, not the capture
                return None
            args, kwargs = call
            if kwargs:
                raise TracingError(f"{error}\n(it cannot be captured in these train()/eval() flags; to run it as "
                                   "written with its children converted, call it with positional arguments only, "
                                   "or pass example_inputs= to convert())") from error
            converted = cls._amp_convert_again(copy, example_inputs=tuple(args))
    if isinstance(converted, fx.GraphModule):
        return _snapshot(converted, gm, cls._amp_model)
    return _as_written_snapshot(converted, gm, flags)


class _AsWrittenCopy:
    """Holds the as-written copy outside gm's module tree (a plain object, not a submodule): gm's state_dict,
    parameters and train() stay the model's."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


def run_as_written(holder: _AsWrittenCopy, args: tuple, kwargs: dict):
    return holder.module(*args, **kwargs)


def _as_written_snapshot(converted: nn.Module, gm: fx.GraphModule, flags: dict[str, bool]) -> dict:
    """A one-call graph that runs `converted` (convert_children's result: the model as written, children
    converted); its summary is converted's, with a note saying which mode this is."""
    graph = fx.Graph()
    args, kwargs = graph.placeholder("*args"), graph.placeholder("**kwargs")
    holder = graph.get_attr(AS_WRITTEN)
    graph.output(graph.call_function(run_as_written, (holder, args, kwargs)))
    mode = "train" if flags.get("") else "eval"
    reason = converted.meta["amp"]["notes"][0]
    children = list(converted.meta["amp"]["children"])
    note = (f"{mode} mode: the model cannot be captured with these train()/eval() flags, so it runs as written with "
            f"{len(children)} converted child{'ren' if len(children) != 1 else ''} ({', '.join(children[:4])}"
            f"{', ...' if len(children) > 4 else ''}), as convert() runs such a model; the other mode keeps its graph")
    warnings.warn(f"amp_compiler: {type(converted).__name__} cannot be captured in {mode} mode "
                  f"({reason.split(': ', 1)[-1]}): in that mode it runs as written, its children converted "
                  f"({', '.join(children[:4])}{', ...' if len(children) > 4 else ''})", UserWarning, stacklevel=5)
    summary = {**converted.meta["amp"], "notes": [note, *converted.meta["amp"]["notes"]]}
    reads = {path: flags.get(path, flag) for path, flag in gm.__dict__.get(READS, {}).items()}
    return {"graph": graph, "summary": summary, "saved": None, "reads": reads,
            "attributes": {AS_WRITTEN: _AsWrittenCopy(converted)}}


def as_written_copy(module: nn.Module) -> nn.Module | None:
    """The model as written (children converted) that `module` runs in its current mode, if it runs one."""
    holder = module.__dict__.get(AS_WRITTEN) if isinstance(module, fx.GraphModule) else None
    if holder is None or not any(node.op == "get_attr" and node.target == AS_WRITTEN for node in module.graph.nodes):
        return None
    return holder.module


def _snapshot(captured: fx.GraphModule, gm: fx.GraphModule, model: nn.Module) -> dict:
    """What switching `gm` to `captured`'s graph needs: the graph, its record, and the root attributes the
    capture added (opaque callees, lifted constants, frozen copies); the model's own modules stay gm's."""
    own = set(model._modules) | set(model._parameters) | set(model._buffers)
    roots = {node.target.split(".")[0] for node in captured.graph.nodes if node.op in ("get_attr", "call_module")}
    return {"graph": captured.graph, "summary": captured.meta["amp"], "saved": getattr(captured, SAVED_ATTRIBUTE, None),
            "reads": dict(captured.__dict__.get(READS, {})),
            "attributes": {name: getattr(captured, name) for name in sorted(roots - own)}}


def training_lines(reads: dict[str, bool]) -> list[str]:
    """explain()'s summary line for a graph that read `training` at capture."""
    if not reads:
        return []
    paths = [path or "the model" for path in reads]
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    modes = sorted({"train" if flag else "eval" for flag in reads.values()})
    return [f"training: {len(paths)} module{'s' if len(paths) > 1 else ''} read self.training while captured ({shown}): this graph is the "
            f"{'/'.join(modes)}-mode one; a call with other train()/eval() flags captures the model again "
            "in those (once; both graphs kept)"]
