"""Name every ONNX node with the canonical op of passes/policy/op_policy.py, so one policy table decides both outputs.

    MatMul -> matmul    Gemm -> linear    Conv (4-D weight) -> conv2d    LayerNormalization -> layer_norm
    Softmax -> softmax  ReduceMean -> mean    Cast -> to    Resize -> interpolate    If -> cond

Writes node.meta["amp"] = {"op": canonical name, "module": module path}; changes nothing else. An op type
without an entry here gets its snake_case name ("NonMaxSuppression" -> "non_max_suppression"), which the
policy table does not know: the rules keep it fp32 and the report names it, as for an unknown fx op.
The module path comes from the torch exporter's name scopes when the model was exported from PyTorch,
so force_fp32=["encoder.layers.0"] patterns work on ONNX files too.
"""
from __future__ import annotations

import ast
import re

import onnx_ir as ir

from amp_compiler.passes.onnx.spec import subgraphs_of
from amp_compiler.passes.runner import PassResult

# Default-domain ONNX op type -> canonical op. Every name on the right is a key of passes.op_policy.POLICY
# (tests/passes/test_onnx_canonicalize.py checks it): no op list is copied here, only spellings.
ONNX_OPS: dict[str, str] = {
    # dense math
    "MatMul": "matmul", "Gemm": "linear", "Einsum": "einsum", "Attention": "scaled_dot_product_attention",
    "PRelu": "prelu", "RNN": "rnn", "LSTM": "lstm", "GRU": "gru",
    # norms, softmax, losses
    "BatchNormalization": "batch_norm", "LayerNormalization": "layer_norm",
    "GroupNormalization": "group_norm", "InstanceNormalization": "instance_norm", "RMSNormalization": "rms_norm",
    "LRN": "local_response_norm", "LpNormalization": "normalize",
    "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "SoftmaxCrossEntropyLoss": "cross_entropy", "NegativeLogLikelihoodLoss": "nll_loss",
    # transcendental
    "Exp": "exp", "Log": "log", "Pow": "pow", "Reciprocal": "reciprocal", "Softplus": "softplus",
    "Acos": "acos", "Asin": "asin", "Cosh": "cosh", "Sinh": "sinh", "Tan": "tan",
    # reductions (ReduceSumSquare and ReduceLogSum are sums first: fp16 overflows there, oc #323)
    "ReduceSum": "sum", "ReduceSumSquare": "sum", "ReduceLogSum": "sum", "ReduceMean": "mean",
    "ReduceProd": "prod", "ReduceLogSumExp": "logsumexp", "ReduceL1": "norm", "ReduceL2": "norm",
    "ReduceMax": "amax", "ReduceMin": "amin", "CumSum": "cumsum", "CumProd": "cumprod",
    # resampling, linear algebra, spectral, accumulating scatter
    "Resize": "interpolate", "Upsample": "upsample", "GridSample": "grid_sample", "AffineGrid": "affine_grid",
    "Det": "det", "DFT": "fft", "STFT": "stft",
    # pointwise arithmetic and activations
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Neg": "neg", "Sqrt": "sqrt", "Clip": "clip",
    "Sum": "add", "Mean": "add",   # elementwise over a few tensors, unlike ReduceSum/ReduceMean
    "Gelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSigmoid": "hardsigmoid", "HardSwish": "hardswish",
    "Mish": "mish", "Elu": "elu", "Selu": "selu", "Celu": "celu", "LeakyRelu": "leaky_relu",
    "Softsign": "softsign", "Erf": "erf", "Sin": "sin", "Cos": "cos", "Atan": "atan",
    # data movement and selection
    "Reshape": "reshape", "Flatten": "flatten", "Squeeze": "squeeze", "Unsqueeze": "unsqueeze",
    "Transpose": "permute", "Expand": "expand", "Tile": "tile", "Slice": "slice", "Split": "split",
    "Concat": "cat", "Gather": "index_select", "GatherElements": "gather", "GatherND": "index",
    "Pad": "pad", "CenterCropPad": "pad", "DepthToSpace": "pixel_shuffle", "SpaceToDepth": "pixel_unshuffle",
    "Identity": "identity", "Dropout": "dropout", "Compress": "masked_select", "ReverseSequence": "flip",
    "Relu": "relu", "ThresholdedRelu": "threshold", "Shrink": "softshrink", "Max": "maximum", "Min": "minimum",
    "Hardmax": "max", "Where": "where",
    "Abs": "abs", "Sign": "sign", "TopK": "topk", "Floor": "floor", "Ceil": "ceil", "Round": "round",
    "ScatterND": "index_put", "ScatterElements": "scatter",
    "RandomNormalLike": "randn_like", "RandomUniformLike": "rand_like",
    # no float output, or only reads metadata
    "Shape": "shape", "Size": "numel", "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt",
    "GreaterOrEqual": "ge", "IsNaN": "isnan", "IsInf": "isinf", "Not": "logical_not", "And": "logical_and",
    "Or": "logical_or", "Xor": "logical_xor", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or",
    "BitwiseNot": "bitwise_not", "ArgMax": "argmax", "ArgMin": "argmin", "NonZero": "nonzero",
    "Range": "arange", "OneHot": "one_hot", "Mod": "remainder",
    # factories and explicit casts: the dtype is an attribute; casts of their outputs fold into it
    "Constant": "tensor", "ConstantOfShape": "full", "EyeLike": "eye", "RandomNormal": "randn",
    "RandomUniform": "rand", "Cast": "to", "CastLike": "type_as",
    # control flow
    "If": "cond", "Loop": "while_loop", "Scan": "scan",
}
# Ops named by their spatial rank: the policy table spells conv2d, avg_pool1d, adaptive_max_pool3d.
RANKED = {"Conv": "conv", "ConvTranspose": "conv_transpose", "AveragePool": "avg_pool", "MaxPool": "max_pool",
          "GlobalAveragePool": "adaptive_avg_pool", "GlobalMaxPool": "adaptive_max_pool"}
# A scatter with a reduction is torch's scatter_add / scatter_reduce; without one it only places values.
SCATTER_REDUCTIONS = {"add": "scatter_add", "mul": "scatter_reduce", "max": "scatter_reduce",
                      "min": "scatter_reduce"}


def canonical_onnx_op(node: ir.Node) -> str:
    if node.domain not in ("", "ai.onnx"):
        return _snake(node.op_type)
    if node.op_type in RANKED:
        return RANKED[node.op_type] + _spatial_rank_suffix(node)
    if node.op_type in ("ScatterND", "ScatterElements"):
        reduction = node.attributes.get("reduction")
        if reduction is not None and reduction.as_string() in SCATTER_REDUCTIONS:
            return SCATTER_REDUCTIONS[reduction.as_string()]
    if node.op_type == "Trilu":
        upper = node.attributes.get("upper")
        return "triu" if upper is None or upper.as_int() else "tril"
    return ONNX_OPS.get(node.op_type, _snake(node.op_type))


def module_path(node: ir.Node) -> str:
    """The torch module a node came from ('encoder.layers.0.attn'), '' when the file does not say."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return ""
    try:
        names = _scope_names(scopes)
    except (ValueError, SyntaxError):
        return ""
    # The last scope is the op itself; the one before it is the innermost module.
    return names[-2] if isinstance(names, list) and len(names) >= 2 else ""


def onnx_canonicalize(model: ir.Model) -> PassResult:
    """Record meta["amp"]["op"] and ["module"] on every node, subgraphs included."""
    for node in all_nodes(model.graph):
        node.meta["amp"] = {"op": canonical_onnx_op(node), "module": module_path(node)}
    return PassResult(modified=False)


def all_nodes(graph: ir.Graph):
    """Every node of `graph` and of its subgraphs, each graph's nodes in order, a subgraph before its owner."""
    for node in list(graph):
        for subgraph in subgraphs_of(node):
            yield from all_nodes(subgraph)
        yield node


# The repr torch.onnx writes, "['', 'layers.0', 'layers.0.attn', 'linear']", read without ast (10x faster);
# a name with quotes or escapes in it takes ast.literal_eval.
_PLAIN_SCOPE_LIST = re.compile(r"\[(?:'[^'\\]*'(?:, '[^'\\]*')*)?\]")
_PLAIN_SCOPE = re.compile(r"'([^']*)'")


def _scope_names(scopes: str):
    if _PLAIN_SCOPE_LIST.fullmatch(scopes):
        return _PLAIN_SCOPE.findall(scopes)
    return ast.literal_eval(scopes)


def _spatial_rank_suffix(node: ir.Node) -> str:
    kernel = node.attributes.get("kernel_shape")
    if kernel is not None:
        return f"{len(kernel.as_ints())}d"
    for value in (node.inputs[1] if node.op_type in ("Conv", "ConvTranspose") and len(node.inputs) > 1 else None,
                  node.inputs[0] if node.inputs else None):
        if value is not None and value.shape is not None and value.shape.rank() >= 3:
            return f"{value.shape.rank() - 2}d"
    return "2d"


def _snake(op_type: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op_type).lower()
