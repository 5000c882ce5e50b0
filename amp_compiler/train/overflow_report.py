"""Where an overflowing mixed-precision step went non-finite: the first node, found by replaying that step.

    if overflowed:                                  # the scaler skipped this step
        report = locate_overflow(model, replay)     # replay(): the same forward+backward once more
        if report is not None:
            log.warning(str(scaler.record_overflow(report)))

A normal step pays nothing: checks exist only during the replay. For the replay every graph of the model
runs node by node through a checking fx.Interpreter (its GraphModule's `forward` is swapped for the replay
and put back after), each floating node output is tested for inf/nan and gets a gradient hook; modules that
run as written (any plain nn.Module, a module holding compiled children) are checked at their inputs and
outputs by module hooks, a coarser granularity. The report names:

    forward     the first node (execution order) whose output went inf/nan, with its module path
    backward    the first node in backward order (nearest the loss) whose gradient w.r.t. its output did
    parameters  the parameters whose .grad is non-finite after the replay

In place (convert(..., inplace=True), amp_compiler.compile with backend="eager") the graphs are the ones dynamo
calls: each is swapped the same way, and the modules inside a compiled forward get no hooks (a
hook there would make dynamo compile again); code dynamo runs between graphs (a graph break) is not checked.

The replay leaves the model as it found it: graphs' forwards, hooks, buffers (batch-norm statistics) and
every parameter's .grad are restored. The RNG is the replay's own (`replay_rng`): started from `rng_state()`
taken when the step began, dropout draws the same masks, and training's stream continues as if nothing ran.
Nothing in the checking raises: a failure there ends the checks and the report says what was found so far.
"""
from __future__ import annotations

import inspect
import math
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.compile import CompiledForward, history_stores
from amp_compiler.dynamo.backend import graphs as dynamo_graphs
from amp_compiler.dynamo.effects import undone_effects   # buffers and amax histories back after the replay
from amp_compiler.insight.graph_decisions import module_of
from amp_compiler.passes.node_facts import facts

MODEL = "<model>"                 # how a report prints the model itself (module path "")
SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
PARAMETERS_SHOWN = 3              # str(report) names this many non-finite parameter gradients


@dataclass
class OverflowReport:
    """What a replay of an overflowing step found; each place is a dict(part, module, node, op, value, dtype,
    found) where `node` is None for a module-level finding (a module run as written)."""
    forward: dict | None = None
    backward: dict | None = None
    parameters: list = field(default_factory=list)
    precision: str = "fp16"        # the model's low dtype, as the first line names it
    note: str | None = None        # the checks stopped early, or the replay raised: why

    def __str__(self) -> str:
        lines = [f"{self.precision} step overflowed: {_forward_line(self.forward)}"]
        if self.backward:
            lines.append(f"first non-finite gradient (nearest the loss): w.r.t. the output of "
                         f"{_place(self.backward)}, {self.backward['value']}")
        elif self.forward:
            lines.append("no checked gradient w.r.t. a node's output went non-finite")
        else:
            lines.append("no checked gradient went non-finite either: look at the loss and the labels")
        if self.parameters:
            shown = ", ".join(self.parameters[:PARAMETERS_SHOWN])
            more = f" and {len(self.parameters) - PARAMETERS_SHOWN} more" if len(self.parameters) > PARAMETERS_SHOWN \
                else ""
            lines.append(f"non-finite .grad in {len(self.parameters)} parameter(s): {shown}{more}")
        if self.note:
            lines.append(f"note: {self.note}")
        return ";\n".join(lines)

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "parameters": list(self.parameters),
                "precision": self.precision, "note": self.note}


def _forward_line(where: dict | None) -> str:
    if where is None:
        return "every checked forward value stayed finite"
    if where["found"] == "model input":   # a non-finite value no module of the model made
        return f"the input of module '{where['module'] or MODEL}' ({where['op']}) was {where['value']} already " \
               f"({where['found']}: check the batch)"
    return f"forward value of {_place(where)} became {where['value']}"


def _place(where: dict) -> str:
    module = where["module"] or MODEL
    if where["node"] is None:
        how = "run as written" if where["found"] == "module output" else where["found"]
        return f"module '{module}' ({where['op']}, {how})"
    return f"node '{where['node']}' ({module}, {where['op']})"


def locate_overflow(model: nn.Module, replay) -> OverflowReport | None:
    """Replay an overflowed step with per-node inf/nan checks; None when the replay stays finite.

    `replay()` runs the same forward and backward once more: same batch, same loss scale, same RNG state
    (run it under `replay_rng(state)`, with `state = rng_state()` taken when the step began, so the training's
    stream is untouched).
    The model, its graphs and the parameters' .grad are left as they were; this never raises."""
    finder, parameters = _Finder(), []
    try:
        parameters = list(model.named_parameters())
        with _checks_installed(model, finder), _grads_kept(parameters), \
                undone_effects(model, history_stores(model)):
            try:
                replay()
            except Exception as error:  # noqa: BLE001 - a report is still wanted; the note names the error
                finder.note = finder.note or f"the replay raised {type(error).__name__}: {_first_line(error)}"
            finder.parameters = [name for name, p in parameters if p.grad is not None and not _finite(p.grad)]
    except Exception as error:  # noqa: BLE001 - installing or removing the checks failed: report what was seen
        finder.note = finder.note or f"the checks failed: {type(error).__name__}: {_first_line(error)}"
    if finder.forward is None and finder.backward is None and not finder.parameters and finder.note is None:
        return None
    return OverflowReport(finder.forward, finder.backward, finder.parameters, _precision_of(model), finder.note)


def rng_state() -> tuple:
    """The RNG state a replay starts from: the CPU generator's and, where CUDA is in use, every device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_in_use() else None


@contextmanager
def replay_rng(state: tuple | None = None):
    """Run a replay on a fork of the RNG: from `state` (an `rng_state()`: dropout draws the masks the skipped
    step drew), or from where the stream is when there is none; afterwards training's stream continues as if
    the replay never ran. The CPU generator is forked, and every CUDA device where CUDA is in use."""
    devices = range(torch.cuda.device_count()) if _cuda_in_use() else []
    with torch.random.fork_rng(devices=devices):
        if state is not None:
            cpu, cuda = state
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        yield


def _cuda_in_use() -> bool:   # never initializes CUDA for a CPU run
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# --- what was seen ------------------------------------------------------------------------------------
class _Finder:
    """The first non-finite forward value and gradient seen; hooks from backward threads share it."""

    def __init__(self):
        self.forward: dict | None = None
        self.backward: dict | None = None
        self.parameters: list = []
        self.note: str | None = None
        self.handles: list = []            # tensor hooks to remove after the replay
        self._lock = threading.Lock()

    @property
    def checking(self) -> bool:
        return self.note is None

    def guarded(self, check, *args) -> None:
        """Run a check; the first failure ends all checks (the report keeps what was found)."""
        if not self.checking:
            return
        try:
            check(*args)
        except Exception as error:  # noqa: BLE001 - a check must never break the user's step
            self.note = f"the checks stopped early ({type(error).__name__}: {_first_line(error)})"

    def saw_forward(self, where: dict, values) -> bool:
        """Record `where` if it is the first non-finite forward value; True when `values` are non-finite."""
        kind, dtype = _non_finite(values)
        if kind is None:
            return False
        self.record_forward(where, kind, dtype)
        return True

    def record_forward(self, where: dict, kind: str, dtype: str) -> None:
        with self._lock:
            if self.forward is None:
                self.forward = {**where, "value": kind, "dtype": dtype}

    def watch_gradients(self, where: dict, values) -> None:
        """Hook the gradients of `values`' tensors that require grad: the first non-finite one is recorded."""
        for tensor in _float_tensors(values):
            if tensor.requires_grad:
                self.handles.append(tensor.register_hook(lambda grad: self.guarded(self._saw_gradient, where, grad)))

    def _saw_gradient(self, where: dict, grad) -> None:
        if self.backward is not None:
            return
        kind, dtype = _non_finite(grad)
        if kind is not None:
            with self._lock:
                if self.backward is None:
                    self.backward = {**where, "value": kind, "dtype": dtype}

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _float_tensors(values) -> list:
    leaves, _ = tree_flatten(values)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided
            and t.device.type != "meta"]


def _non_finite(values) -> tuple:
    """("nan" | "inf", dtype name) of the first non-finite tensor among values, else (None, None)."""
    with torch.no_grad():
        for tensor in _float_tensors(values):
            if not bool(torch.isfinite(tensor).all()):
                kind = "nan" if bool(torch.isnan(tensor).any()) else "inf"
                return kind, str(tensor.dtype).removeprefix("torch.")
    return None, None


def _only_negative_inf(values) -> bool:
    """Every non-finite entry is -inf: an additive attention mask rather than an overflow, at a module's input."""
    with torch.no_grad():
        return all(bool((torch.isfinite(t) | (t == -math.inf)).all()) for t in _float_tensors(values))


def _finite(tensor: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(torch.isfinite(tensor).all())


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:200]


# --- graphs: node by node -----------------------------------------------------------------------------
class _CheckingInterpreter(fx.Interpreter):
    """Runs a converted graph node by node, checking each value and hooking its gradient.

    A node whose infinity is intended is not an overflow: a constant +-inf written into finite inputs
    (masked_fill(mask, -inf), full(-inf)) and what only such values reach while staying free of nan."""

    def __init__(self, gm: fx.GraphModule, finder: _Finder, part: str | None):
        super().__init__(gm)
        self.finder, self.part = finder, part
        self.non_finite: dict = {}      # node -> "intended" | "overflow", for the nodes seen non-finite

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if node.op not in ("placeholder", "get_attr", "output"):
            self.finder.guarded(self._check, node, result)
        return result

    def _check(self, node: fx.Node, result) -> None:
        where = _node_place(node, self.part)
        kind, dtype = _non_finite(result)
        if kind is not None:
            intended = self._intended(node, kind)
            self.non_finite[node] = "intended" if intended else "overflow"
            if not intended:
                self.finder.record_forward(where, kind, dtype)
        if not _is_parameter_cast(node):   # a parameter's gradient is reported under `parameters`
            self.finder.watch_gradients(where, result)

    def _intended(self, node: fx.Node, kind: str) -> bool:
        inputs = [self.non_finite[n] for n in node.all_input_nodes if n in self.non_finite]
        if not inputs:
            return _has_infinite_constant(node)
        return kind == "inf" and all(state == "intended" for state in inputs)


def _is_parameter_cast(node: fx.Node) -> bool:
    """A cast of a weight: what it casts is a get_attr or a parameter input (a weight-cache cast also reads the
    cache's check, a second input that is no weight)."""
    weight = node.args[0] if node.args else None
    return facts(node).get("op") == "cast" and isinstance(weight, fx.Node) and \
        (weight.op == "get_attr" or _is_parameter_input(weight))


def _is_parameter_input(node: fx.Node) -> bool:
    """A dynamo graph's placeholder that is a parameter of the model (dynamo passes weights as inputs)."""
    inputs = node.graph.owning_module.meta.get("amp", {}).get("graph_inputs", {})
    return node.op == "placeholder" and inputs.get(node.name, {}).get("kind") == "parameter"


def _has_infinite_constant(node: fx.Node) -> bool:
    leaves, _ = tree_flatten((node.args, node.kwargs))
    return any(isinstance(value, float) and math.isinf(value) for value in leaves)


def _node_place(node: fx.Node, part: str | None) -> dict:
    """`part`: the path of the compiled module whose graph holds `node` (its graph names modules from it)."""
    module = _join(part, module_of(node)) if part is not None else module_of(node)
    return {"part": part, "module": module, "node": node.name, "op": facts(node).get("op") or str(node.target),
            "found": "node output"}


def _join(path: str, child: str) -> str:
    return f"{path}.{child}" if path and child else path or child


def _checking_forward(gm: fx.GraphModule, finder: _Finder, part: str | None, compiled):
    signature = inspect.signature(compiled)

    def forward(*args, **kwargs):
        if not finder.checking:
            return compiled(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return _CheckingInterpreter(gm, finder, part).run(*bound.args)
        except Exception as error:  # noqa: BLE001 - the compiled graph decides whether the call itself fails
            finder.note = finder.note or (f"the checks stopped early (graph of {part or MODEL!r} did not run node "
                                          f"by node: {type(error).__name__}: {_first_line(error)})")
        return compiled(*args, **kwargs)
    return forward


# --- modules run as written: inputs and outputs -------------------------------------------------------
class _ModuleChecks:
    """Forward hooks on every module that runs as itself: a module's non-finite output (or an input already
    non-finite when it arrives: the enclosing module's own code, or the batch itself, made it) when no node
    has been named. Modules inside a compiled forward get none: its graphs' nodes are checked instead, and a
    hook there would make dynamo compile again."""

    def __init__(self, model: nn.Module, finder: _Finder):
        self.model, self.finder = model, finder
        self.running: list = []        # paths of the modules whose forward is under way, innermost last
        self.modules = dict(model.named_modules())
        self.compiled: list = []       # paths of the compiled modules
        self.handles: list = []

    def install(self) -> None:
        self.compiled = inside = list(_compiled_modules(self.model))
        for path, module in self.modules.items():
            if any(path.startswith(f"{part}.") if part else path for part in inside):
                continue
            self.handles += [module.register_forward_pre_hook(self._before(path, module), with_kwargs=True),
                             module.register_forward_hook(self._after(path, module), always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _before(self, path: str, module: nn.Module):
        def hook(_module, args, kwargs):
            self.finder.guarded(self._check_inputs, path, module, args, kwargs)
            self.running.append(path)
        return hook

    def _after(self, path: str, module: nn.Module):
        def hook(_module, _args, output):
            if self.running and self.running[-1] == path:
                self.running.pop()
            self.finder.guarded(self._check_output, path, module, output)
        return hook

    def _check_inputs(self, path: str, module: nn.Module, args, kwargs) -> None:
        if self.finder.forward is not None:
            return
        if not self.running:        # called by the replay itself (the model, a LightningModule's child): the
            self.finder.saw_forward(self._place(path, module, "model input"), (args, kwargs))   # batch, non-finite
            return
        first, rest = (args[:1], (args[1:], kwargs)) if args else ((), (args, kwargs))
        suspects = [first] + ([] if _only_negative_inf(rest) else [rest])   # a -inf mask argument is no overflow
        parent = self.running[-1]
        where = self._place(parent, self.modules[parent], f"own code, before calling '{path or MODEL}'")
        for values in suspects:
            if self.finder.saw_forward(where, values):
                return

    def _check_output(self, path: str, module: nn.Module, output) -> None:
        where = self._place(path, module, "module output")
        self.finder.saw_forward(where, output)
        self.finder.watch_gradients(where, output)

    def _place(self, path: str, module: nn.Module, found: str) -> dict:
        return {"part": self._part_of(path), "module": path, "node": None, "op": type(module).__name__,
                "found": found}

    def _part_of(self, path: str) -> str | None:
        """The innermost compiled module holding `path`; None for other models."""
        within = [p for p in self.compiled if p == "" or path == p or path.startswith(p + ".")]
        return max(within, key=len) if within else None


# --- installing and undoing ---------------------------------------------------------------------------
class _checks_installed:
    """Checking forwards on the model's graphs and hooks on its modules, for the replay only."""

    def __init__(self, model: nn.Module, finder: _Finder):
        self.model, self.finder = model, finder

    def __enter__(self):
        self.stack = ExitStack()
        try:
            for gm in _graph_modules(self.model):
                self._swap_forward(gm, None)
            for prefix, compiled in _compiled_modules(self.model).items():
                for gm in dynamo_graphs(compiled):
                    self._swap_forward(gm, prefix)
                self._check_new_graphs(compiled_record(compiled).converter.watchers, prefix)
            self.module_checks = _ModuleChecks(self.model, self.finder)
            self.stack.callback(self.module_checks.remove)
            self.module_checks.install()
        except BaseException:
            self.stack.close()
            raise
        return self

    def _check_new_graphs(self, watchers: list, prefix: str) -> None:
        """A graph dynamo makes during the replay (a first call, a recompile) is checked node by node too."""
        def watch(gm):
            self._swap_forward(gm, prefix)
        watchers.append(watch)
        self.stack.callback(lambda: watchers.remove(watch) if watch in watchers else None)

    def _swap_forward(self, gm: fx.GraphModule, part: str | None) -> None:
        had = "forward" in gm.__dict__
        own = gm.__dict__.get("forward")
        gm.__dict__["forward"] = _checking_forward(gm, self.finder, part, gm.forward)

        def put_back():
            if had:
                gm.__dict__["forward"] = own
            else:
                gm.__dict__.pop("forward", None)
        self.stack.callback(put_back)

    def __exit__(self, *exc):
        try:
            self.stack.close()
        finally:
            self.finder.remove_hooks()
        return False


def _compiled_modules(model: nn.Module) -> dict:
    """{module path: module} of the modules in `model` whose forward TorchDynamo compiles for amp_compiler."""
    return {path: module for path, module in model.named_modules()
            if isinstance(compiled_record(module), CompiledForward)}


def _graph_modules(model: nn.Module) -> list:
    """The GraphModules in the model's tree (convert() results, a model holding them)."""
    return [module for module in model.modules() if isinstance(module, fx.GraphModule)]


class _grads_kept:
    """The replay's gradients start from None and the parameters' own .grad is back afterwards."""

    def __init__(self, named_parameters: list):
        self.parameters = [p for _, p in named_parameters]

    def __enter__(self):
        self.saved = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None
        return self

    def __exit__(self, *exc):
        for p, grad in zip(self.parameters, self.saved):
            p.grad = grad
        return False


def _precision_of(model: nn.Module) -> str:
    try:
        return _low_dtype_name(model)
    except Exception:  # noqa: BLE001 - only a label: the report must not fail for it
        return "mixed-precision"


def _low_dtype_name(model: nn.Module) -> str:
    compiled = list(_compiled_modules(model).values())
    if compiled:
        name = str(compiled_record(compiled[0]).config.low_dtype).removeprefix("torch.")
    else:
        name = next((str(m.meta.get("amp", {}).get("dtype")) for m in model.modules()
                     if isinstance(m, fx.GraphModule) and "amp" in m.meta), "mixed-precision")
    return SHORT_DTYPES.get(name, name)
