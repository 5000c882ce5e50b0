"""Name every fx node's target with one canonical op, so one policy table serves every graph flavour.

    call_module Linear | F.linear | Tensor.__matmul__ | aten.linear.default   ->  meta["amp"]["op"] = "linear"

Works on symbolic-trace graphs (nn modules, torch functions, Tensor methods, operators) and on
torch.export graphs (ATen overloads). Writes facts(node)["op"]; changes nothing else.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import IN_PLACE_OPERATORS
from amp_compiler.passes.policy.op_aliases import canonical_op_name   # IR-neutral: the ONNX passes name ops by it too

# Leaf module classes, most specific first (isinstance order matters for subclasses).
MODULE_OPS: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"), (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"), (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"), (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"), (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.RMSNorm, "rms_norm"), (nn.LocalResponseNorm, "local_response_norm"),
    (nn.Embedding, "embedding"), (nn.EmbeddingBag, "embedding_bag"),
    (nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn"),
    (nn.LSTMCell, "lstm_cell"), (nn.GRUCell, "gru_cell"), (nn.RNNCell, "rnn_tanh_cell"),
    (nn.modules.dropout._DropoutNd, "dropout"), (nn.PReLU, "prelu"), (nn.Identity, "identity"),
)
LEAF_MODULE_TYPES = tuple(cls for cls, _ in MODULE_OPS)


def mutates_first_input(node: fx.Node) -> bool:
    """In-place ops (x.add_(y), F.relu(x, inplace=True), h += y) write into their first argument."""
    if node.op not in ("call_method", "call_function"):
        return False
    if node.kwargs.get("inplace") is True:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[0] if target._schema.arguments else None
        return bool(first is not None and first.alias_info is not None and first.alias_info.is_write)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_OPERATORS


# Tensor attributes that are not tensors (getattr reads them without math); any other attribute a graph reads
# (a ModelOutput's field behind an opaque call, x.T) is a value, painted like getitem.
METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda",
                                 "is_sparse", "is_quantized", "is_meta", "names", "itemsize", "nbytes"})


def canonical_op(node: fx.Node, root: nn.Module) -> str:
    """The canonical op name of one node ('placeholder', 'get_attr', 'output' for the graph's edges)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    target = node.target
    if node.op == "call_module":
        module = root.get_submodule(target)
        for cls, name in MODULE_OPS:
            if isinstance(module, cls):
                return name
        if type(module).__name__ == "GuardsFn":  # torch.export's shape guards: checks, no math
            return "guards"
        if hasattr(module, "amp_canonical_op"):  # the front end's own helper modules name their op
            return module.amp_canonical_op
        return "module:" + type(module).__name__
    if node.op == "call_method":
        return canonical_op_name(target)
    if isinstance(target, torch._ops.OpOverload):
        return canonical_op_name(target.overloadpacket.__name__)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return canonical_op_name(target.__name__)
    if target is getattr:   # x.shape, x.dtype: metadata; out.last_hidden_state: a value picked from a container
        return "getattr" if node.args[1] in METADATA_ATTRIBUTES else "getitem"
    if target is operator.getitem:
        return "getitem"
    if target is operator.matmul:
        return "matmul"
    name = getattr(target, "__name__", None) or str(target)
    return canonical_op_name(name)


def canonicalize(gm: fx.GraphModule) -> PassResult:
    """Record meta["amp"]["op"] and ["inplace"] on every node."""
    for node in gm.graph.nodes:
        amp = facts(node)
        amp["op"] = canonical_op(node, gm)
        amp["inplace"] = mutates_first_input(node)
    return PassResult(modified=False)
