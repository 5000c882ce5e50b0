"""Static dtype propagation on an fx graph: which values are floating tensors, and of which dtype.

    meta["amp"]["dtype"] = torch.float32 | torch.float16 | torch.int64 | ... | None (not a tensor / unknown)

Before painting it records the dtypes the original model computes in (what painting may change and what
keep_io_types restores) in ["dtype"] and ["original_dtype"]; after painting it records what the rewritten
graph will compute in, which is what cast insertion reads. Facts come first from propagation: a node's
meta["val"] (the fake value torch.export or `propagate_values` recorded); the rules below are only
for what nothing propagated (no example inputs) and for the painted graph, whose painted nodes compute
in their precision. Placeholders without a value take the model's float dtype (fp32, or fp64 for a
model.double()). `amp_compiler.verify` checks the result.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from amp_compiler.passes.fx.runtime import is_float
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts

METHOD_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64, "long": torch.int64, "int": torch.int32, "bool": torch.bool}
_PROMOTION_ORDER = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _promote(dtypes) -> torch.dtype | None:
    floats = [d for d in dtypes if d in _PROMOTION_ORDER]
    if not floats:
        return None
    if torch.float16 in floats and torch.bfloat16 in floats:
        floats.append(torch.float32)
    return max(floats, key=_PROMOTION_ORDER.index)


def _explicit_dtype(node: fx.Node, dtypes: dict) -> torch.dtype | None:
    if node.op == "call_method" and node.target in METHOD_DTYPES:
        return METHOD_DTYPES[node.target]
    for value in (*node.args, *node.kwargs.values()):
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, fx.Node) and value.target is getattr and value.args[1:] == ("dtype",):
            return dtypes.get(value.args[0])   # y.to(out.dtype): out's dtype as painted (an fp32 accumulator)
    if node.target == "type_as" and len(node.args) > 1:
        return dtypes.get(node.args[1])
    return None


def _module_param_dtype(gm: fx.GraphModule, node: fx.Node) -> torch.dtype | None:
    if node.op != "call_module":
        return None
    return _promote(p.dtype for p in gm.get_submodule(node.target).parameters(recurse=False))


def value_dtype(value) -> torch.dtype | None:
    """The dtype of a (fake) value: a tensor's, or the promoted float dtype of the tensors in a container."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list, dict)):
        dtypes = [v.dtype for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
        return _promote(dtypes) or (dtypes[0] if dtypes else None)
    return None


def _call_dtype(gm: fx.GraphModule, node: fx.Node, dtypes: dict, low: torch.dtype) -> torch.dtype | None:
    amp = facts(node)
    original = amp.get("original_dtype")
    if "class" not in amp:   # before painting: a propagated value is the fact
        if "val" in node.meta:
            return value_dtype(node.meta["val"])
    elif original is not None and not is_float(original):
        return original      # painting never changes int, bool or fp64 values
    inputs = [dtypes.get(a) for a in node.all_input_nodes]
    base = POLICY.get(amp.get("op"))  # before painting only the table knows which ops are non-float
    family = amp.get("family", base.family if base else None)
    op_class = amp.get("class", base.op_class if base else None)
    if op_class == "ignore":
        if family == "user_cast":
            explicit = _explicit_dtype(node, dtypes)
            return explicit if explicit is not None else _promote(inputs)
        if family == "factory":
            return _explicit_dtype(node, dtypes) or torch.get_default_dtype()
        if family in ("inplace", "shape"):   # an in-place op, or a view it writes through: its operand's dtype
            return dtypes.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        if family == "embedding":  # the table's dtype (aten.embedding(weight, indices) or F.embedding)
            return _module_param_dtype(gm, node) or _promote(inputs)
        if family == "opaque":      # returns the policy's output dtype, else what its inputs promote to
            policy = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], tuple) else (None, None)
            return policy[1] or _promote(inputs)
        return None
    precision = amp.get("precision")
    if precision == "low":
        return low
    if precision == "fp32":
        return torch.float32
    # Unpainted: the op computes in the promoted dtype of its float inputs (and its own parameters).
    explicit = _explicit_dtype(node, dtypes)
    if explicit is not None and explicit.is_floating_point:
        return explicit
    return _promote([*inputs, _module_param_dtype(gm, node)])


def _unknown_input_dtype(gm: fx.GraphModule) -> torch.dtype:
    """An input nothing tells the dtype of: the model's own float dtype when all its floating parameters and
    buffers share one (a model.double() is called with float64, which is never cast), else fp32."""
    floats = {t.dtype for t in (*gm.parameters(), *gm.buffers()) if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else torch.float32


def infer_dtypes(gm: fx.GraphModule, example_inputs=None, low: torch.dtype = torch.float16) -> PassResult:
    """Write meta["amp"]["dtype"] on every node, in topological order."""
    dtypes: dict[fx.Node, torch.dtype | None] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = dict(zip(placeholders, example_inputs)) if example_inputs is not None and \
        len(placeholders) == len(example_inputs) else {}
    for node in gm.graph.nodes:
        amp = facts(node)
        if node.op == "placeholder":
            if "val" in node.meta:
                dtype = value_dtype(node.meta["val"])
            elif node in given:
                dtype = value_dtype(given[node])
            else:
                dtype = _unknown_input_dtype(gm) if not node.name.startswith("_") else None
        elif node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            dtype = value.dtype if isinstance(value, torch.Tensor) else None
        elif node.op == "output":
            dtype = None
        else:
            dtype = _call_dtype(gm, node, dtypes, low)
        dtypes[node] = dtype
        amp["dtype"] = dtype
        if "class" not in amp:
            amp["original_dtype"] = dtype
    return PassResult(modified=False)

