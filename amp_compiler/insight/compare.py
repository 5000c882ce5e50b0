"""compare(model, gm, inputs): which node of a mixed-precision graph is to blame for its error.

    report = amp_compiler.compare(model, gm, (x,))
    compare (float16 graph against fp32): 20 float nodes, tolerance 0.01 of each value's scale: FAILED (outputs ...)
      output output[0] (output) float32: max abs inf, inf of scale, inf ulp, 8 non-finite where fp32 is finite
      first node past tolerance: masked_fill_float16 (cast) float16: max abs inf, ... 4 non-finite where fp32 is finite
      chain: q_bias_float16 -> linear -> matmul -> matmul_float32 -> masked_fill -> masked_fill_float16

The fp32 reference of every node comes from replaying the converted graph with its casts as identities
(and opaque bodies as written, without autocast): the same nodes compute in fp32, so each node's value
is matched with its own fp32 value, node by node. The model itself runs too, to check that the replay
computes what the model computes (a note says when it does not). Both run in eval mode, without grad.
At the fp8 level the replay runs each fp8 matmul in fp32 on its high-precision operands and takes each fp8 copy
as its exact scaled value (FP8_REPLAY), and the default tolerance is FP8_RTOL where float8 matmuls run
(default_rtol; the report's first line says which default applied and why).
validate_onnx(..., compare_intermediates=True) returns the same ComparisonReport for an ONNX file (its
NodeErrors name ONNX nodes and their output values; tensor_error and worst_chain are shared).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.converted import compiled_record
from amp_compiler.frozen import packed_frozen_linear
from amp_compiler.insight.graph_decisions import graph_summary, is_cast, module_of
from amp_compiler.passes.fx import fp8_runtime as fp8
from amp_compiler.passes.fx.freeze_weight_casts import amp_frozen_fp8_weight
from amp_compiler.passes.fx.runtime import amp_frozen_cast, amp_frozen_module_call, amp_module_call
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name

MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float8_e4m3fn": 3, "float8_e5m2": 2}
DEFAULT_RTOL = {"float16": 1e-2, "bfloat16": 5e-2}
# With float8 matmuls (compare(): level "fp8" with matmuls lowered; validate_onnx: float8 weights or Q to float8).
# e4m3 keeps 3 mantissa bits: a cast rounds by up to 1/16 of its value. Worst errors of correct models against
# fp32 measured (zoo, size small, fp8_min_dim=16, seeds 0-9 (mlp 0-29); gpt/bert full, seed 0):
#   compare(), recipes current / margin 2 / delayed (3 training calls first) / rowwise, frozen or not:
#     outputs 0.096 (mlp seed 4; gpt 0.058, bert 0.053, gcn 0.051, gat 0.032), any node 0.105 (a row-wise cast);
#   validate_onnx, export_onnx (computed or calibrated scales) and convert_onnx files, seeds 0-4 and full:
#     outputs 0.101 (mlp seed 4; bert full 0.072, gpt 0.055, gat 0.047, gcn 0.029), any value 0.101.
# The recipes hardly differ: a power-of-two scale moves exponents, not the rounding. 0.15 is 1.4x the worst.
# Broken on purpose, seed 0: every scale 2x (each operand's top binade saturates) puts outputs 0.26-0.57 off on
# mlp/gpt/bert but 0.14 / 0.15 on gcn / gat (gcn's passes); one matmul unscaled 2x wrong: 0.50-0.63 at the
# outputs of mlp/gcn/gat, 0.05 on gpt/bert (the query projection: softmax's input, its own node 0.5 off).
FP8_RTOL = 0.15
FP8_MATMULS = (fp8.fp8_scaled_linear, fp8.fp8_scaled_matmul, fp8.fp8_linear, fp8.fp8_matmul)
FP8_SCALES = (fp8.fp8_scale, fp8.fp8_delayed_scale)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)   # an fp8 copy's ulp is its own, not the low dtype's
SHOWN_WORST = 8
SHOWN_CHAIN = 10     # a longer chain prints its first 2 and last 5 nodes (chain holds them all)


@dataclass
class NodeError:
    """One value's error against fp32 (an fx node's, or an ONNX node output's)."""
    node: str
    op: str
    module: str
    dtype: str               # what the converted graph computed in
    shape: tuple
    max_abs: float
    max_rel: float           # max_abs over the scale: the largest finite |fp32 value| of this node
    ulps: float              # max_abs in steps of the low dtype at that scale
    non_finite: int          # elements inf/nan in the graph where fp32 is finite
    ok: bool
    value: str = ""          # ONNX: the value's name (a node may have several outputs); fx: ""

    def __str__(self) -> str:
        where = f", {self.module}" if self.module else ""
        value = f" -> {self.value}" if self.value and self.value != self.node else ""
        inf = f", {self.non_finite} non-finite where fp32 is finite" if self.non_finite else ""
        return (f"{self.node} ({self.op}{where}){value} {self.dtype}: max abs {self.max_abs:.3g}, "
                f"{self.max_rel:.3g} of scale, {self.ulps:.3g} ulp{inf}")


@dataclass
class ComparisonReport:
    """What compare() and validate_onnx() return: per-node error against fp32, worst first."""
    low_dtype: str
    rtol: float
    errors: list[NodeError]               # every float node, worst first
    outputs: list[NodeError]
    first_failure: NodeError | None = None    # in graph order
    chain: list[NodeError] = field(default_factory=list)   # from an input to first_failure, worst input each step
    notes: list[str] = field(default_factory=list)
    atol: float = 0.0                     # allowed on top of rtol x scale
    rtol_from: str = ""                   # which default rtol is and why ("" when the caller gave it)
    source: str = ""                      # validate_onnx: the file compared; compare(): ""
    providers: list[str] = field(default_factory=list)   # validate_onnx: ONNX Runtime's providers

    @property
    def passed(self) -> bool:
        return all(error.ok for error in self.outputs)

    def __str__(self) -> str:
        verdict = "passed (outputs within tolerance)" if self.passed else "FAILED (outputs past tolerance)"
        head = f"validate {self.source} on {self.providers[0]}" if self.source else \
            f"compare ({self.low_dtype} graph against fp32)"
        atol = f" + {self.atol:g}" if self.atol else ""
        why = f" ({self.rtol_from})" if self.rtol_from else ""
        lines = [f"{head}: {len(self.errors)} float nodes, tolerance {self.rtol:g} of each value's scale{atol}{why}: "
                 f"{verdict}"]
        lines += [f"  output {error}" for error in self.outputs]
        if self.first_failure is not None:
            label = "first drifting node" if self.source else "first node past tolerance"   # each one's old wording
            lines.append(f"  {label}: {self.first_failure}")
            shown = self.chain if len(self.chain) <= SHOWN_CHAIN else [*self.chain[:2], None, *self.chain[-5:]]
            skipped = f"... ({len(self.chain) - 7} more)"
            lines.append("  chain: " + " -> ".join(skipped if e is None else e.node for e in shown))
            lines += [f"    {skipped if error is None else error}" for error in shown]
        elif self.errors:
            lines.append("  no node past tolerance")
        if self.errors:
            lines.append("  worst nodes:")
            lines += [f"    {error}" for error in self.errors[:SHOWN_WORST]]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self) | {"passed": self.passed}


def compare(model: nn.Module, gm: fx.GraphModule, inputs, *, rtol: float | None = None) -> ComparisonReport:
    """Run `model` in fp32 and `gm` (its conversion) on `inputs`; the error of every node, worst first,
    the first node past `rtol` (relative to the node's value scale; default 1e-2 fp16, 5e-2 bf16, FP8_RTOL
    when the graph runs float8 matmuls: default_rtol) and the chain of nodes that leads to it."""
    if (record := compiled_record(gm)) is not None:   # in place: each graph a call runs
        return record.compare(model, gm, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), rtol)
    if not isinstance(gm, fx.GraphModule):
        raise ValueError("compare() takes the GraphModule convert() returned; for a model run as written "
                         "(its children converted), compare each child with the inputs it receives")
    low = graph_summary(gm)["dtype"]
    rtol, rtol_from = (rtol, "") if rtol is not None else default_rtol(gm)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    with _eval_mode(model, gm), torch.no_grad():
        model_out = _run_model(model, inputs)   # first: inputs the model refuses are the user's to fix
        candidate, candidate_out = _run(gm, inputs, fp32=False)
        reference, reference_out = _run(gm, inputs, fp32=True, scales=fp8_scales(gm, candidate))
    errors = {}
    for node in gm.graph.nodes:
        if node in reference and node in candidate:
            errors[node] = _node_error(node, candidate[node], reference[node], low, rtol)
    outputs = [_node_error(None, c, r, low, rtol, name=f"output[{i}]")
               for i, (c, r) in enumerate(zip(_leaves(candidate_out), _leaves(reference_out)))]
    report = ComparisonReport(low, rtol, sorted(errors.values(), key=badness, reverse=True), outputs,
                              notes=_replay_notes(reference_out, model_out), rtol_from=rtol_from)
    first = next((node for node, error in errors.items() if not error.ok), None)
    if first is not None:
        report.first_failure, report.chain = errors[first], _chain(first, errors)
    return report


def default_rtol(*graphs: fx.GraphModule) -> tuple[float, str]:
    """(compare()'s rtol for the converted graph(s), why): FP8_RTOL when converted at level fp8 with float8 matmuls
    in them (lower_fp8_matmuls' count; where none qualified the graph computes as bf16 O1 and keeps bf16's
    default), else their low dtype's. Several graphs: a model converted in place, judged as one."""
    summaries = [graph_summary(gm) for gm in graphs]
    low, levels = summaries[0]["dtype"], {summary.get("level") for summary in summaries}
    counts = [summary.get("pass_counts", {}).get("lower_fp8_matmuls", {}) for summary in summaries]
    lowered = sum(count.get("fp8", _fp8_matmuls(gm)) for count, gm in zip(counts, graphs))
    if lowered:
        kept = sum(count.get("kept", 0) for count in counts)
        also = f", {kept} kept {low}" if kept else ""
        return FP8_RTOL, f"fp8 default: {lowered} matmul{'s' * (lowered != 1)} run in float8{also}"
    because = ", level fp8 lowered no matmul to float8" if "fp8" in levels else ""
    return DEFAULT_RTOL.get(low, 1e-2), f"{low} default{because}"


def _fp8_matmuls(gm: fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in FP8_MATMULS)


def _run_model(model: nn.Module, inputs: tuple):
    try:
        return model(*inputs)
    except Exception as error:  # noqa: BLE001 - named with the inputs, in one line
        raise ValueError(f"compare(): the model itself fails on these inputs ({describe_inputs(inputs)}): "
                         f"{type(error).__name__}: {first_line(error)}") from error


def describe_inputs(inputs: tuple) -> str:
    return ", ".join(f"{dtype_name(x.dtype)}{list(x.shape)}" if isinstance(x, torch.Tensor)
                     else type(x).__name__ for x in inputs)


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps every node's float tensor; fp32=True replays it without its casts."""

    def __init__(self, gm: fx.GraphModule, fp32: bool, inputs: tuple = (), scales: dict | None = None):
        super().__init__(gm)
        self.fp32, self.values, self.inputs = fp32, {}, inputs
        self.scales = scales or {}     # fp32 replay: the fp8 scales the converted graph took, by node
        self.extra_traceback = False   # a failure names the node itself

    def run_node(self, node: fx.Node):
        try:
            return self._record(node)
        except Exception as error:  # noqa: BLE001 - the model ran on these inputs: the graph is what fails
            where = f"node {node.name}" + (f" (module {module_of(node)!r})" if module_of(node) else "")
            replay = "its fp32 replay" if self.fp32 else "the converted graph"
            raise ValueError(f"compare(): the model runs on these inputs ({describe_inputs(self.inputs)}) but "
                             f"{replay} fails at {where}: {type(error).__name__}: {first_line(error)}") from error

    def _record(self, node: fx.Node):
        if self.fp32 and (is_cast(node) or node.target is amp_frozen_cast):   # the weight comes first in both
            result = self.env[node.args[0]] if isinstance(node.args[0], fx.Node) else node.args[0]
        elif self.fp32 and facts(node).get("family") == "opaque":
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            result = node.target(args[0], (None, None), *args[2:], **kwargs)   # as written: no autocast
        elif self.fp32 and node.target in (amp_module_call, amp_frozen_module_call):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            first = 2 if node.target is amp_module_call else 3   # the frozen call also takes the copies
            result = args[0](*args[first:], **kwargs)             # a low leaf (an RNN) with its fp32 parameters
        elif self.fp32 and node.target is packed_frozen_linear:   # the weight itself, not its packed low copy
            (x, weight, bias, *_), _ = self.fetch_args_kwargs_from_env(node)
            result = torch.nn.functional.linear(x, weight, bias)
        elif self.fp32 and node.op == "call_function" and node.target in FP8_REPLAY:
            result = FP8_REPLAY[node.target](self, node, *self.fetch_args_kwargs_from_env(node))
        else:
            result = super().run_node(node)
        if node.op != "output" and isinstance(result, torch.Tensor) and result.is_floating_point():
            self.values[node] = result.detach()
        return result


# The fp32 replay of the fp8 level's nodes (passes/fx/fp8_runtime.py): the matmul in fp32 on its high-precision
# operands, each fp8 copy as its exact scaled value (x * scale: unrounded, unsaturated), each scale the one the
# converted graph took (a power of two from an amax that bf16 rounding can move across a binade). So outputs are
# the fp32 model's, and an fp8 cast's error is its rounding and saturation at the graph's own scale.
def _bound(node: fx.Node, args, kwargs) -> dict:
    bound = inspect.signature(node.target).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _fp32_linear(recorder, node, args, kwargs):
    call = _bound(node, args, kwargs)
    x, w = call.get("x", call.get("a")), call.get("weight", call.get("b"))
    if node.target in (fp8.fp8_scaled_matmul, fp8.fp8_matmul):   # b is (K, N)
        w = w.t()
    return torch.nn.functional.linear(x, w, call.get("bias"))


def _fp32_scale(recorder, node, args, kwargs):
    return recorder.scales[node] if node in recorder.scales else node.target(*args, **kwargs)


def _fp32_fp8_copy(recorder, node, args, kwargs):
    call = _bound(node, args, kwargs)
    return call["x"].float() * call["scale"]


def _fp32_frozen_fp8_weight(recorder, node, args, kwargs):
    weight = _bound(node, args, kwargs)["weight"]
    scale = node.target(*args, **kwargs)[2]         # the cached copy's scale, as the converted graph reads it
    return weight, weight.float() * scale, scale


FP8_REPLAY = {**dict.fromkeys(FP8_MATMULS, _fp32_linear), **dict.fromkeys(FP8_SCALES, _fp32_scale),
              fp8.fp8_cast: _fp32_fp8_copy, amp_frozen_fp8_weight: _fp32_frozen_fp8_weight}


def _run(gm, inputs, fp32: bool, scales: dict | None = None):
    recorder = _Recorder(gm, fp32, inputs, scales)
    out = recorder.run(*inputs)
    return recorder.values, out


def fp8_scales(gm: fx.GraphModule, values: dict) -> dict:
    """The fp8 scales a run of the converted graph recorded, for its fp32 replay to take."""
    return {node: values[node] for node in gm.graph.nodes if node.op == "call_function" and node.target in FP8_SCALES
            and node in values}


def _node_error(node, candidate: torch.Tensor, reference: torch.Tensor, low: str, rtol: float,
                name: str | None = None) -> NodeError:
    amp = facts(node) if node is not None else {}
    return tensor_error(candidate, reference, low, rtol, node=name or node.name, op=amp.get("op", "output"),
                        module=module_of(node) if node is not None else "")


def tensor_error(candidate: torch.Tensor, reference: torch.Tensor, low: str, rtol: float, atol: float = 0.0, *,
                 node: str, op: str, module: str = "", value: str = "") -> NodeError:
    """The error of one value against its fp32 reference; ok when finite wherever fp32 is and within
    atol + rtol x scale (the largest finite |fp32 value|)."""
    a, b = candidate.double(), reference.double()
    if a.shape != b.shape:
        max_abs, scale, non_finite = math.inf, 0.0, 0
    else:
        same = (a == b) | (a.isnan() & b.isnan())              # equal infinities agree
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
        diff = torch.where(diff.isnan(), math.inf, diff)                  # nan against a number: as bad as inf
        max_abs = diff.max().item() if diff.numel() else 0.0
        finite = b[b.isfinite()].abs()
        scale = finite.max().item() if finite.numel() else 0.0
        non_finite = int((~a.isfinite() & b.isfinite()).sum())
    bits = MANTISSA_BITS.get(dtype_name(candidate.dtype) if candidate.dtype in FP8_DTYPES else low, 10)
    ulp = 2.0 ** (math.floor(math.log2(scale)) - bits) if scale > 0 else math.inf
    relative = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return NodeError(node, op, module, dtype_name(candidate.dtype), tuple(candidate.shape), max_abs,
                     relative, max_abs / ulp if max_abs else 0.0, non_finite,
                     non_finite == 0 and max_abs <= rtol * scale + atol + 1e-12, value)


def badness(error: NodeError) -> tuple:
    return (error.non_finite > 0, error.max_rel if not math.isnan(error.max_rel) else math.inf)


def _chain(node: fx.Node, errors: dict) -> list[NodeError]:
    return worst_chain(node, errors, lambda n: n.all_input_nodes)


def worst_chain(start, errors: dict, inputs_of) -> list[NodeError]:
    """Back from `start` through the input with the largest relative error, to where the error starts
    (errors: by node or value; inputs_of: what a key reads)."""
    chain = [start]
    while len(chain) < 64:
        sources = [n for n in inputs_of(chain[-1]) if n in errors and n not in chain]
        if not sources:
            break
        worst = max(sources, key=lambda n: badness(errors[n]))
        if errors[worst].max_rel == 0 and errors[worst].non_finite == 0:
            break
        chain.append(worst)
    return [errors[n] for n in reversed(chain)]


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _replay_notes(replayed, model_out) -> list[str]:
    notes = []
    for i, (r, m) in enumerate(zip(_leaves(replayed), _leaves(model_out))):
        if r.shape != m.shape or not torch.allclose(r.double(), m.double(), rtol=1e-4, atol=1e-5, equal_nan=True):
            notes.append(f"output[{i}]: the fp32 replay of the graph differs from the model itself (a trace "
                         "specialised to other inputs?); node errors are against the replay")
    return notes


class _eval_mode:
    """Both in eval mode (dropout off, batch norm on running statistics), restored afterwards."""

    def __init__(self, *modules: nn.Module):
        self.modules = modules

    def __enter__(self):
        self.flags = [{m: m.training for m in module.modules()} for module in self.modules]
        for module in self.modules:
            module.eval()

    def __exit__(self, *exc):
        for flags in self.flags:
            for module, flag in flags.items():
                module.training = flag

