"""Frozen inference: each weight a low-precision op reads is cast once, not on every call.

    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, freeze=True)   # or amp_compiler.freeze(gm)
    gm.eval()
    with torch.inference_mode():
        gm(x)          # first call: casts the weights and keeps the copies; later calls cast no weight
    amp_compiler.frozen_bytes(gm)   # what the copies cost
    amp_compiler.frozen.pack_linears(gm)   # CPU, bf16: linears read oneDNN-packed copies instead (faster)

A copy is used only while it is still the weight's: same tensor object (load_state_dict(assign=True) or a
new Parameter replace it), same version counter (optimizer steps, load_state_dict, in-place ops under
no_grad), same storage and shape (`param.data = t`), and the same values at a sample of positions
(`param.data.mul_(...)` writes through `.data`, which PyTorch gives a version counter of its own, so only the
values can tell). Otherwise it is made again. The values of all weights are compared in one operation at the
start of each call (one device sync per call: on an H200 a comparison per weight made a frozen BERT-base
call 1.9x autocast's time); a model converted in place shares one holder across its graphs
(dynamo/weight_cache.py). In training mode, when autograd needs the weight's gradient
(grad enabled and requires_grad), and inside torch.compile, the weight is cast on every call as before
(a compiled frozen graph checking its copies ran 1.26-1.30x slower than the compiled unfrozen one).
At the fp8 level each fp8 matmul's weight is kept once as float8_e4m3fn with its scale (read_fp8; 1 byte a
weight, not bf16's 2), made by the graph's own scaling functions so the output is bit for bit the unfrozen one;
at fp8_scaling="delayed" the copy is made again when the weight's amax history changes too.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.converted import compiled_record
from amp_compiler.passes.fx.fp8_runtime import fp8_amax, fp8_cast, fp8_delayed_scale, fp8_scale
from amp_compiler.passes.fx.freeze_weight_casts import freeze_weight_casts
from amp_compiler.passes.fx.runtime import amp_cast, amp_frozen_cast, graph_leaf

HOLDER = "amp_frozen_weights"
SAMPLES = 16   # values compared per call: catches writes through .data that scale, fill or copy the weight


@dataclass
class _Copy:
    source: weakref.ref
    version: int
    storage: tuple           # data_ptr, shape: `param.data = t` keeps the version, changes these
    sampled: torch.Tensor    # a strided view of the weight's values (aliases its storage)
    sample: torch.Tensor     # what those values were when `low` was made
    low: torch.Tensor
    scale: torch.Tensor | None = None    # an fp8 copy's: low ~= weight * scale (per tensor, or one per row)
    history: tuple | None = None         # delayed scaling: (weakref, version) of the amax history the scale read

    @staticmethod
    def of(weight: torch.Tensor, make, history: torch.Tensor | None = None) -> "_Copy":
        """make(weight) -> (low copy, its fp8 scale or None)."""
        with torch.inference_mode(False), torch.no_grad():   # a normal tensor, also made under inference_mode
            low, scale = make(weight.detach())
            sampled = _sampled_view(weight)
            copy = _Copy(weakref.ref(weight), weight._version, (weight.data_ptr(), weight.shape), sampled,
                         sampled.clone(), low, scale=scale,
                         history=(weakref.ref(history), history._version) if history is not None else None)
        return copy

    def still_of(self, weight: torch.Tensor, history: torch.Tensor | None = None) -> bool:
        """Cheap checks, no device work; the sampled values are compared for all copies at once (check)."""
        return (self.source() is weight and self.version == weight._version
                and self.storage == (weight.data_ptr(), weight.shape)
                and (history is None or self.history == (weakref.ref(history), history._version)))

    def values_unchanged(self) -> bool:
        return torch.equal(self.sampled, self.sample)


def fp8_copy(low: torch.Tensor, fp8_dtype: torch.dtype, dim: int | None, margin: int,
             delayed: tuple | None = None) -> tuple:
    """(fp8 copy, scale) of a weight already in the matmul's dtype: the scaling nodes lower_fp8_matmuls writes
    (fp8_amax -> fp8_scale or fp8_delayed_scale -> fp8_cast), called as functions, so a frozen copy is bit for
    bit the unfrozen one. delayed: (Fp8History, which, amax_from)."""
    amax = fp8_amax(low, dim)
    if delayed is None:
        scale = fp8_scale(amax, fp8_dtype, margin)
    else:
        histories, which, amax_from = delayed
        scale = fp8_delayed_scale(amax, histories, which, fp8_dtype, margin, amax_from)
    return fp8_cast(low, scale, fp8_dtype), scale


def _sampled_view(weight: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLES values spread over the weight, as a view of its storage (a strided weight: its first)."""
    detached = weight.detach()
    if not detached.is_contiguous():
        return detached.as_strided((min(1, detached.numel()),), (1,))
    flat = detached.view(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)]


def _joined_samples(copies: list[_Copy]) -> list[tuple[list[_Copy], torch.Tensor]]:
    """The copies by device, each group's samples joined: one comparison per device covers all of them."""
    groups: dict[torch.device, list[_Copy]] = {}
    for copy in copies:
        groups.setdefault(copy.sample.device, []).append(copy)
    return [(group, torch.cat([c.sample for c in group])) for group in groups.values()]


def _values_unchanged(joined: list[tuple[list[_Copy], torch.Tensor]]) -> bool:
    return all(torch.equal(torch.cat([c.sampled for c in group]), sample) for group, sample in joined)


class FrozenWeights(nn.Module):
    """The low-precision copies of one graph's weights, keyed by (weight, dtype). No parameters, no buffers:
    the state_dict is the model's; the copies are not saved (torch.save/deepcopy drop them)."""

    def __init__(self, sample_values: bool = True):
        super().__init__()
        self.sample_values = sample_values   # False: no value comparison, so no device sync per call
        self._copies: dict[tuple[int, torch.dtype], _Copy] = {}
        self._samples: list[tuple[list[_Copy], torch.Tensor]] | None = None   # per device, joined
        self.copies_made = 0

    def check(self) -> None:
        """Drop every copy whose weight's sampled values changed: one comparison per device for all weights."""
        if not self.sample_values or self.training or torch.compiler.is_compiling() or not self._copies:
            return
        if self._samples is None:
            self._samples = _joined_samples(list(self._copies.values()))
        if not _values_unchanged(self._samples):   # rare: find which changed
            self.drop_changed()

    def drop_changed(self) -> None:
        """Drop the copies whose weight's sampled values differ from when they were made."""
        self._copies = {key: c for key, c in self._copies.items() if c.values_unchanged()}
        self._copies_changed()

    def _copies_changed(self) -> None:
        self._samples = None

    def casts_each_call(self, weight: torch.Tensor) -> bool:
        """While training, when autograd needs the weight, and under torch.compile (the checks would be guards:
        inductor folds casts), no copy is kept: the weight is cast as in the unfrozen graph."""
        return self.training or (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling()

    def read(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.casts_each_call(weight):
            if self._copies and torch.is_grad_enabled() and weight.requires_grad:
                self._forget(weight, dtype)   # a step will change it: the copy would be stale, its bytes wanted
            return amp_cast(weight, dtype)
        return self._copy(weight, dtype, lambda w: (w.to(dtype), None)).low

    def read_fp8(self, weight: torch.Tensor, dtype: torch.dtype, fp8_dtype: torch.dtype, dim: int | None,
                 margin: int, delayed: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the weight the fp8 matmul node takes for autograd, its fp8 copy, that copy's scale): the copy and scale
        computed from the weight cast to `dtype` as the graph's own nodes compute them (fp8_copy). A frozen copy
        is all an inference call reads: the matmul node gets the weight itself (no `dtype` copy is kept), which
        it reads for its shape and, in a backward, its gradient; when the weight is cast each call, the cast.
        `delayed`: (Fp8History, "w", amax_from): the scale is the history's, so the copy is made again when the
        history changes too; while the history records (training mode) the weight is quantized every call."""
        if self.casts_each_call(weight) or (delayed is not None and delayed[0].training):
            low = amp_cast(weight, dtype)
            return (low, *fp8_copy(low, fp8_dtype, dim, margin, delayed))
        history = getattr(delayed[0], delayed[1]) if delayed is not None else None
        recipe = (id(delayed[0]), *delayed[1:]) if delayed is not None else None
        copy = self._copy(weight, (dtype, fp8_dtype, dim, margin, recipe),
                          lambda w: fp8_copy(amp_cast(w, dtype), fp8_dtype, dim, margin, delayed), history)
        return weight, copy.low, copy.scale

    def _copy(self, weight: torch.Tensor, kind, make, history: torch.Tensor | None = None) -> _Copy:
        """The copy of `weight` of this `kind` (a dtype, or an fp8 recipe), made again when it is not the weight's
        (or, delayed, when its scale's history changed)."""
        key = (id(weight), kind)
        copy = self._copies.get(key)
        if copy is None or not copy.still_of(weight, history):
            # copies of weights that are gone (a replaced Parameter) go too
            self._copies = {k: c for k, c in self._copies.items() if c.source() is not None}
            copy = self._copies[key] = _Copy.of(weight, make, history)
            self._copies_changed()
            self.copies_made += 1
        return copy

    def _forget(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        """Drop this weight's plain and packed copies (the others' stay: a LoRA base keeps its copies while its
        adapters train)."""
        dropped = [self._copies.pop(key, None) for key in ((id(weight), dtype), (id(weight), ("packed", dtype)))]
        if any(copy is not None for copy in dropped):
            self._copies_changed()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self._copies.values()
                   for t in (c.low, c.scale) if t is not None)

    def clear(self) -> None:
        self._copies.clear()
        self._copies_changed()

    def __getstate__(self):
        state = super().__getstate__().copy()
        state["_copies"], state["_samples"] = {}, None
        return state

    def __deepcopy__(self, memo):
        return FrozenWeights(self.sample_values).train(self.training)


_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


@graph_leaf
def packed_frozen_linear(input, weight, bias, dtype: torch.dtype, copies):
    """linear(input, weight in `dtype`, bias) where the cache `copies` keeps only the weight's oneDNN-packed bf16
    copy (no plain one: the bytes of autocast's cached cast, not twice them). Wherever a packed copy cannot serve
    (autograd needs the weight, not a bf16 CPU oneDNN linear, torch.compile tracing) it casts and runs linear."""
    # fuse_packed_linears wrote this node for a 2-d weight, bf16, where oneDNN packs bf16: what is left to check
    if (copies.casts_each_call(weight) or input.dtype is not dtype or weight.device.type != "cpu"
            or input.dim() < 2 or input.requires_grad or (bias is not None and bias.dtype is not dtype)):
        return torch._C._nn.linear(input, copies.read(weight, dtype), bias)
    packed = copies._copy(weight, ("packed", dtype),
                          lambda w: (torch.ops.mkldnn._reorder_linear_weight(w.to(dtype)), None)).low
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [None], "")


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fuse_packed_linears(gm: fx.GraphModule) -> int:
    """A frozen graph's linears whose bf16 weight copy nothing else reads call packed_frozen_linear (the cache then
    holds the packed copy alone); returns how many. Linears of other weights, and other dtypes, stay."""
    count = 0
    for node in list(gm.graph.nodes) if _packing_available() else ():
        cast = node.args[1] if node.op == "call_function" and node.target in _LINEARS and len(node.args) > 1 \
            else None
        if (not isinstance(cast, fx.Node) or cast.target is not amp_frozen_cast or cast.args[1] is not torch.bfloat16
                or node.kwargs or any(user.target not in _LINEARS or user.args[1] is not cast for user in cast.users)
                or _ndim(gm, cast.args[0]) != 2):
            continue
        weight, dtype, copies = cast.args
        bias = node.args[2] if len(node.args) > 2 else None
        node.target, node.args = packed_frozen_linear, (node.args[0], weight, bias, dtype, copies)
        node.meta["amp"] = {**node.meta.get("amp", {}),
                            "rule": f"{node.meta.get('amp', {}).get('rule', 'low')}; weight cached oneDNN-packed"}
        if not cast.users:
            gm.graph.erase_node(cast)
        count += 1
    if count:
        gm.recompile()
    gm.meta["amp"].setdefault("frozen", {})["linears_packed"] = count
    return count


def _ndim(gm: fx.GraphModule, weight: fx.Node) -> int | None:
    """The weight's number of dimensions: its recorded value's (dynamo's graphs, or example_inputs), or the
    tensor a get_attr node names (an fx graph converted without example inputs)."""
    value = weight.meta.get("val")
    if value is None and weight.op == "get_attr":
        value = getattr(gm.get_submodule(weight.target.rpartition(".")[0]), weight.target.rpartition(".")[2], None)
    return getattr(value, "ndim", None)


def pack_linears(model: nn.Module) -> nn.Module:
    """Let the frozen graphs of `model` (convert(..., freeze=True) or freeze() results) run their linears on
    oneDNN-packed copies of the frozen bf16 weights, on CPU: a decode step of a 4x512 Llama (batch 1, 1 thread) 20%
    faster. A weight only linears read is kept packed instead of plain (the same bytes); one that other ops read
    too keeps its plain copy and its linears stay as they are. Returns `model`.
    On TorchDynamo's capture (convert(model, inplace=True)) the weight cache packs them already, keeping the packed
    copy only: nothing to do, unless the model was compiled with weight_cache=False."""
    record = compiled_record(model)
    if record is not None:
        if not all(forward.converter.caches_weights for forward in record.forwards(model)):
            raise TypeError("pack_linears() packs cached weight copies; this model was compiled with "
                            "weight_cache=False (or backend='inductor'): compile it with weight_cache=True")
        return model
    graphs = [m for m in model.modules() if isinstance(m, fx.GraphModule) and hasattr(m, HOLDER)]
    if not graphs:
        raise TypeError(f"pack_linears() packs frozen weight copies; {type(model).__name__} holds no frozen graph: "
                        "convert it with freeze=True or call amp_compiler.freeze() first")
    for gm in graphs:
        pack_frozen_linears(gm)
    return model


def pack_frozen_linears(gm: fx.GraphModule) -> None:
    """A frozen graph's bf16 linears read oneDNN-packed copies, as the in-place weight cache's do
    (fuse_packed_linears; their count: gm.meta["amp"]["frozen"]["linears_packed"]); a graph packed already is
    left as it is."""
    if "linears_packed" not in gm.meta["amp"]["frozen"]:
        fuse_packed_linears(gm)


def _converted_graphs(model: nn.Module) -> list[fx.GraphModule]:
    return [m for m in model.modules() if isinstance(m, fx.GraphModule) and "amp" in m.meta
            and not hasattr(m, HOLDER)]


def freeze(model: nn.Module, *, sample_values: bool = True) -> nn.Module:
    """Let every converted graph in `model` (a convert() result, or a model whose children convert() converted)
    keep low-precision copies of the weights it casts; returns `model`, changed in place. Copies are made on
    the first inference call; call it in eval mode under torch.no_grad()/inference_mode().
    `sample_values=False`: copies are checked by identity, version counter and storage only, with no device
    sync per call; a write through `.data` (param.data.mul_()) then goes unseen: for serving a model nothing
    writes to, e.g. latency-bound GPU inference."""
    if not isinstance(sample_values, bool):
        raise TypeError(f"sample_values must be True or False, got {sample_values!r}")
    record = compiled_record(model)
    if record is not None:   # amp_compiler.compile / convert(inplace=True): its weight cache is the freeze
        forwards = record.forwards(model)   # with those compiled with it (an encoder) or its children's
        if not all(forward.converter.caches_weights for forward in forwards):
            raise TypeError("this model was compiled with weight_cache=False (or backend='inductor'): compile it "
                            "again with weight_cache=True to keep low weight copies")
        for forward in forwards:
            forward.converter.weight_cache.sample_values = sample_values
        return model
    graphs = _converted_graphs(model)
    if not graphs and not any(hasattr(m, HOLDER) for m in model.modules()):
        raise TypeError(f"freeze() takes what amp_compiler.convert() returned; {type(model).__name__} holds no "
                        "converted graph")
    for gm in graphs:
        freeze_graph(gm, sample_values, training=gm.training)
    return model


def freeze_graph(gm: fx.GraphModule, sample_values: bool = True, *, training: bool = False,
                 weight_inputs: dict | None = None, holder: FrozenWeights | None = None) -> dict:
    """One converted graph reads its weights' low copies from a FrozenWeights (gm.amp_frozen_weights): its own, or
    `holder`, shared by graphs of one model (one copy per weight for all of them). `weight_inputs` as
    freeze_weight_casts takes it (a graph whose weights are inputs). Returns the pass's counts, also in
    gm.meta["amp"]["frozen"]."""
    gm.add_submodule(HOLDER, holder if holder is not None else FrozenWeights(sample_values).train(training))
    counts = freeze_weight_casts(gm, HOLDER, weight_inputs).counts
    gm.graph.lint()
    gm.recompile()
    gm.meta["amp"]["frozen"] = counts
    return counts


def frozen_bytes(model: nn.Module) -> int:
    """Bytes the low-precision weight copies of `model`'s frozen graphs hold now."""
    record = compiled_record(model)   # in place: its graphs lie outside the model's module tree
    graphs = [gm for _, gm, _ in record.graphs(model)] if record is not None else []
    holders = {id(m): m for root in (model, *graphs) for m in root.modules() if isinstance(m, FrozenWeights)}
    return sum(m.nbytes() for m in holders.values())   # a holder shared by graphs counted once
