"""Shared test helpers: tolerances, runtime dtype recording, graph queries."""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_compiler.passes.fx.runtime import is_cast


class LinearNormNet(nn.Module):
    """Linear -> softmax -> a transposed copy -> LayerNorm: every kind of pass has work on it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x).softmax(-1).t().contiguous().t())


# Error allowed relative to the reference output's magnitude: fp16 keeps 11 bits, bf16 8.
RELATIVE_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-6}


def assert_close_to_fp32(output: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                         data_scale: float = 1e-3, loosen: float = 1.0) -> float:
    """`data_scale`: the magnitude of the values the model computed with, when outputs can be small by
    cancellation (x - mean(x)): low-precision rounding is relative to those, not to the result.
    `loosen`: a factor on the tolerance, for levels that run fragile ops (norms, exp) in low precision."""
    output, reference = output.detach().float(), reference.detach().float()
    assert output.shape == reference.shape
    assert torch.isfinite(output).all(), "non-finite values in the converted model's output"
    error = (output - reference).abs().max().item()
    scale = max(reference.abs().max().item(), data_scale)
    assert error <= RELATIVE_TOLERANCE[dtype] * loosen * scale, f"max error {error:.3g} vs output scale {scale:.3g}"
    return error / scale


class AtenDtypeRecorder(TorchDispatchMode):
    """Records, for every ATen op that runs, the dtypes of its floating tensor inputs."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, list[tuple]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        dtypes = tuple(a.dtype for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point())
        self.calls[func.overloadpacket.__name__].append(dtypes)
        return func(*args, **kwargs)

    def input_dtypes(self, *op_names: str) -> set:
        return {d for name in op_names for dtypes in self.calls.get(name, []) for d in dtypes}


PROFILER_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
                   "double": torch.float64}


class ProfiledDtypes:
    """AtenDtypeRecorder's answers from torch.profiler (record_shapes=True gives each op's input dtypes): a
    TorchDispatchMode makes TorchDynamo run a frame as written, so it cannot observe a model on dynamo's capture.
    Op names as AtenDtypeRecorder takes them ("addmm"), or with a namespace ("mkldnn::_linear_pointwise"). The
    profiler also records the fake-tensor ops of dynamo's tracing: profile a call that compiles nothing. Entered
    again, it adds the new calls' events to those it holds."""

    def __init__(self):
        self.events: list[tuple[str, list]] = []

    def __enter__(self):
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)
        self.events += [(e.name, e.input_dtypes) for e in self.profile.events()]

    @property
    def calls(self) -> dict[str, list]:
        """{op name: [its input dtypes, per call]}, as AtenDtypeRecorder's (for a failing assertion's message)."""
        found: dict[str, list] = defaultdict(list)
        for name, dtypes in self.events:
            found[name.removeprefix("aten::")].append(tuple(dtypes))
        return dict(found)

    def input_dtypes(self, *op_names: str) -> set:
        names = {name if "::" in name else f"aten::{name}" for name in op_names}
        return {PROFILER_DTYPES[d] for name, dtypes in self.events if name in names for d in dtypes
                if d in PROFILER_DTYPES}


def cast_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_cast(n)]


class PaintedAs(set):
    """The precisions one op was painted with; its repr names the nodes, so a failed comparison says which
    node went where (`{'low'} == {'fp32'}` alone does not)."""

    def __init__(self):
        super().__init__()
        self.nodes: dict[str, str] = {}    # node name -> precision

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}: {precision}" for name, precision in list(self.nodes.items())[:8])
        more = f", ... ({len(self.nodes)} nodes)" if len(self.nodes) > 8 else ""
        return f"{set(self)!r} ({shown}{more})"


def precision_by_op(gm: fx.GraphModule) -> dict[str, PaintedAs]:
    """canonical op -> set of precisions it was painted with (a set that names its nodes when printed)."""
    found: dict[str, PaintedAs] = defaultdict(PaintedAs)
    for node in gm.graph.nodes:
        amp = node.meta.get("amp", {})
        if amp.get("precision") is not None:
            found[amp["op"]].add(amp["precision"])
            found[amp["op"]].nodes[node.name] = amp["precision"]
    return found


def assert_cast_invariants(gm: fx.GraphModule) -> None:
    """No cast chains, at most one cast per (value, dtype), no cast to the dtype a value already has."""
    gm.graph.lint()
    seen = set()
    for cast in cast_nodes(gm):
        source, dtype = cast.args
        assert not is_cast(source), f"cast chain at {cast.name}"
        assert (source, dtype) not in seen, f"duplicate cast of {source.name} to {dtype}"
        seen.add((source, dtype))
        assert source.meta["amp"].get("dtype") != dtype, f"{cast.name} casts to the dtype {source.name} has"
        assert cast.users, f"dead cast {cast.name}"


class WithLoss(torch.nn.Module):
    """A model and its loss as one module, so the loss op is in the converted graph too."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, inputs, target):
        return self.loss_fn(self.model(inputs), target)


@contextlib.contextmanager
def one_torch_thread():
    """torch's intra-op pool at one thread for the block (tiny models: bit-identical runs, no pool contention on
    shared cores), restored after: the body of each test file's `one_thread` fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
