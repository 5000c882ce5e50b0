"""Fold each eval-mode BatchNorm into the convolution before it, for an inference export.

    y = bn(conv(x))          ->   y = conv'(x)      conv'.weight = conv.weight * g / sqrt(var + eps)   (per channel)
                                                    conv'.bias   = (conv.bias - mean) * g / sqrt(var + eps) + b
                                                    bn is gone (nn.Identity in the module tree)

In eval mode a batch norm is a fixed per-channel affine map, and the convolution before it is linear per
output channel, so the pair is one convolution with other weights: every inference stack folds it, and
torch.onnx's own optimizer does for an fp32 export. For a mixed-precision export the fold must come *before*
painting: O1 keeps norms fp32, so an unfolded BatchNorm sits fp32 between two casts and drags the ReLU/Add
around it into fp32 (ResNet-18: 40 casts where the folded fp32 model converted by convert_onnx has 5).
Folding the exported ONNX afterwards would remove the BatchNorm but keep those neighbours' fp32 decisions;
folding the module tree first lets convert() paint the graph an inference runtime actually executes, and
works the same whatever the level decides for batch norms (fp32, or low activations with fp32 statistics).
The folded weights are computed in fp32 and rounded to fp16 once, where the convolution runs low.

Steps, so the user's model is never touched:
  find_foldable_batch_norms(gm)         analysis of a captured graph (torch.fx leaf modules, or torch.export
                                        ATen ops): the (conv, batch norm) module paths that can be folded
  fold_batch_norms(root, pairs)         rewrite of a module tree the caller owns (a share_module_tree copy):
                                        new convolution modules with new parameters, nn.Identity for the norms
  fold_batch_norms_in_graph(gm, pairs)  the same on a torch.fx capture (its tree is its own): the graph is
                                        then the one a capture of the folded model gives, without capturing again
  fold_batch_norms_in_aten_graph(gm, pairs)   the same on a torch.export capture's ATen graph
A pair folds when the conv output's only reader is the norm, each module runs exactly once and its
parameters are read nowhere else, the conv is a plain nn.Conv1d/2d/3d (not parametrized, no subclass
forward such as weight standardisation) and the norm a plain BatchNorm with running statistics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.fusion import fuse_conv_bn_weights

from amp_compiler.passes.fx.module_tree_edits import fresh_copy, get_module, set_module
from amp_compiler.passes.runner import PassResult

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)            # exact types: a subclass may transform its weight in forward
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_ATEN_CONVS = ("conv1d", "conv2d", "conv3d")
_ATEN_BATCH_NORM = "batch_norm"


@dataclass(frozen=True)
class ConvBatchNorm:
    conv: str            # module path of the convolution
    norm: str            # module path of the batch norm that reads its output
    nodes: tuple[str, str]   # their node names in the captured graph (force_* patterns may name them)


def find_foldable_batch_norms(gm: fx.GraphModule) -> list[ConvBatchNorm]:
    """The (conv, batch norm) pairs of `gm` that fold_batch_norms can fold, in graph order."""
    calls = [_module_call(gm, node) for node in gm.graph.nodes]
    calls = {node: path for node, path in zip(gm.graph.nodes, calls) if path is not None}
    runs: dict[str, int] = {}
    for path in calls.values():
        runs[path] = runs.get(path, 0) + 1
    pairs = []
    for node, path in calls.items():
        module = get_module(gm, path)
        if type(module) not in BATCH_NORMS or not _has_running_stats(module):
            continue
        source = node.args[0] if node.args else None
        conv_path = calls.get(source) if isinstance(source, fx.Node) else None
        if conv_path is None or type(get_module(gm, conv_path)) not in CONVS or len(source.users) != 1:
            continue
        conv = get_module(gm, conv_path)
        if runs[path] != 1 or runs[conv_path] != 1 or parametrize.is_parametrized(conv) or \
                conv.out_channels != module.num_features or conv.weight.dtype != torch.float32 or \
                not _parameters_read_only_by(gm, conv_path, source) or not _parameters_read_only_by(gm, path, node):
            continue
        pairs.append(ConvBatchNorm(conv_path, path, (source.name, node.name)))
    return pairs


def fold_batch_norms(root: nn.Module, pairs: list[ConvBatchNorm]) -> PassResult:
    """Replace, in `root` (a module tree the caller owns), each pair's conv by the folded conv and its norm
    by nn.Identity. The modules and tensors `root` held before are left as they were."""
    for pair in pairs:
        conv, norm = get_module(root, pair.conv), get_module(root, pair.norm)
        with torch.no_grad():
            weight, bias = fuse_conv_bn_weights(conv.weight, conv.bias, norm.running_mean, norm.running_var,
                                                norm.eps, norm.weight, norm.bias)
        folded = fresh_copy(conv)
        folded.weight, folded.bias = weight, bias
        set_module(root, pair.conv, folded)
        set_module(root, pair.norm, nn.Identity())
    return PassResult(modified=bool(pairs), counts={"batch_norms_folded": len(pairs)})


def fold_batch_norms_in_graph(gm: fx.GraphModule, pairs: list[ConvBatchNorm]) -> PassResult:
    """fold_batch_norms on `gm`'s own module tree (a torch.fx capture's): each norm's call_module node now calls
    the nn.Identity (a leaf), and says so in its module stack, as in a capture of the folded model."""
    result = fold_batch_norms(gm, pairs)
    norms = {pair.norm for pair in pairs}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack and any(path in norms for path, _ in stack.values()):
            node.meta["nn_module_stack"] = type(stack)((key, (path, nn.Identity if path in norms else kind))
                                                       for key, (path, kind) in stack.items())
    return result


def fold_batch_norms_in_aten_graph(gm: fx.GraphModule, pairs: list[ConvBatchNorm]) -> PassResult:
    """fold_batch_norms on `gm`'s own module tree (a torch.export capture's), and its ATen graph as a capture of
    the folded model gives it: each folded batch_norm node goes with its reads of the norm's tensors (its
    readers read the conv), a conv without bias reads the new `bias`, the batch_norm nodes left are numbered
    again from `batch_norm` as torch.export names them. The train flag the norms read may be left unread: the
    front end settles it (frontend/export_capture.py, settle_training_flag)."""
    calls = {path: node for node in gm.graph.nodes if (path := _module_call(gm, node)) is not None}
    result = fold_batch_norms(gm, pairs)   # before the edits below: the norms are nn.Identity after it
    graph = gm.graph
    for pair in pairs:
        conv, norm = calls[pair.conv], calls[pair.norm]
        norm.replace_all_uses_with(conv)
        graph.erase_node(norm)
        for read in [n for n in graph.nodes if n.op == "get_attr" and n.target.startswith(pair.norm + ".")]:
            graph.erase_node(read)
        if (conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")) is None:
            with graph.inserting_after(conv.args[1]):   # beside the weight read, as a capture orders them
                bias = graph.get_attr(pair.conv + ".bias")
            bias.meta = {key: value for key, value in conv.args[1].meta.items() if key != "val"}
            conv.args = (*conv.args[:2], bias, *conv.args[3:])
            conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
    if pairs:
        gm.graph = _batch_norms_numbered_again(graph)
    return result


def _batch_norms_numbered_again(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose batch_norm nodes are named batch_norm, batch_norm_1, ... in graph order (an fx
    graph never frees the names of erased nodes, so the copy is a new graph); every other name is kept."""
    numbered = fx.Graph()
    values: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        aten = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
            node.target.overloadpacket.__name__ == _ATEN_BATCH_NORM
        values[node] = numbered.create_node(node.op, node.target, fx.map_arg(node.args, values.get),
                                            fx.map_arg(node.kwargs, values.get),
                                            name=_ATEN_BATCH_NORM if aten else node.name, type_expr=node.type)
        values[node].meta = node.meta
    numbered._codegen = graph._codegen   # flattens inputs, rebuilds the output type
    return numbered


def _module_call(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The module path a conv/batch-norm node runs: a call_module target, or (torch.export) the owner of
    the weight an ATen conv/batch_norm reads."""
    if node.op == "call_module":
        return node.target
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = node.target.overloadpacket.__name__
    if name not in _ATEN_CONVS and name != _ATEN_BATCH_NORM:
        return None
    weight = node.args[1] if len(node.args) > 1 else None
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not weight.target.endswith(".weight"):
        return None
    path = weight.target[:-len(".weight")]
    expected = CONVS if name in _ATEN_CONVS else BATCH_NORMS
    return path if isinstance(get_module(gm, path), expected) else None


def _parameters_read_only_by(gm: fx.GraphModule, path: str, reader: fx.Node) -> bool:
    """No node but `reader` reads the module's tensors (get_attr of `path.weight` ... elsewhere)."""
    prefix = path + "."
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.startswith(prefix) and any(u is not reader for u in node.users):
            return False
    return True


def _has_running_stats(norm: nn.Module) -> bool:
    return norm.track_running_stats and norm.running_mean is not None and norm.running_var is not None
