"""The op policy: one data table, keyed by canonical op name, that says how each op treats precision.

Classes (TensorFlow's auto-mixed-precision vocabulary):
  allow  - run in low precision: tensor-core matmul/conv work, accumulated in fp32 by the kernels.
  infer  - follow the inputs: pointwise math that is safe in low precision when its inputs already are.
  deny   - run in fp32: overflow, underflow or accumulation error would hurt the result.
  clear  - numerically neutral: moves or selects values, never changes them.
  ignore - never painted and never cast: the output is not a floating tensor (shapes, indices, masks).

Each entry has a family (what levels and reports group by) and a one-line reason. The bf16 overlay says
where bf16 (fp32's exponent range, 8 bits of mantissa) needs less care than fp16; a device overlay
(DEVICE_OVERLAYS) denies, on a device, the ops it has no kernel for in a low dtype. Levels O2/O3 are
expressed as re-classification by family in `passes.rules`, never as edits of this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

CLASSES = ("allow", "infer", "deny", "clear", "ignore")


@dataclass(frozen=True)
class OpRule:
    op: str
    op_class: str           # allow | infer | deny | clear | ignore (CLASSES)
    family: str
    reason: str


def _rules(op_class: str, family: str, reason: str, ops: str) -> list[OpRule]:
    return [OpRule(op, op_class, family, reason) for op in ops.split()]


_TABLE: list[OpRule] = [
    # --- allow: the work tensor cores exist for; kernels accumulate in fp32 internally.
    *_rules("allow", "matmul", "dense matmul: tensor-core throughput, fp32 accumulation inside the kernel",
            "linear matmul mm bmm mv addmm addmv addr addbmm baddbmm einsum chain_matmul multi_dot bilinear tensordot"),
    *_rules("allow", "matmul", "grouped matmul (a mixture of experts' experts, one group of tokens per expert): "
            "dense matmuls, fp32 accumulation inside the kernel", "grouped_mm grouped_mm_fallback"),
    *_rules("allow", "conv", "convolution: tensor-core throughput, fp32 accumulation inside the kernel",
            "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution conv_tbc"),
    *_rules("allow", "attention", "fused attention kernels keep softmax statistics in fp32 internally",
            "scaled_dot_product_attention"),
    *_rules("allow", "activation", "prelu is a pointwise multiply with a learned slope; autocast lowers it",
            "prelu"),
    *_rules("allow", "rnn", "recurrent cells are matmul-bound; cuDNN keeps the state math in fp32",
            "rnn lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell"),
    # --- deny: numerically fragile.
    *_rules("deny", "norm", "mean/variance statistics need fp32 accumulation and range",
            "batch_norm layer_norm group_norm instance_norm rms_norm local_response_norm"),
    *_rules("deny", "softmax", "exp of unbounded logits overflows fp16; the normaliser needs fp32",
            "softmax log_softmax softmin"),
    *_rules("deny", "loss", "losses sum many small terms and take logs: fp32 keeps them exact",
            "cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss kl_div "
            "binary_cross_entropy binary_cross_entropy_with_logits poisson_nll_loss gaussian_nll_loss "
            "cosine_embedding_loss hinge_embedding_loss margin_ranking_loss multi_margin_loss "
            "multilabel_margin_loss multilabel_soft_margin_loss soft_margin_loss triplet_margin_loss "
            "triplet_margin_with_distance_loss ctc_loss"),
    *_rules("deny", "transcendental", "overflows or loses precision in fp16 over a small input range",
            "exp expm1 exp2 log log2 log10 log1p pow float_power reciprocal rsqrt acos asin cosh sinh tan "
            "erfinv softplus lgamma digamma"),
    *_rules("deny", "reduction", "reductions accumulate many terms: fp16 overflows past 65504 and rounds",
            "sum prod cumsum cumprod logsumexp std var var_mean std_mean nuclear_norm renorm "
            "cosine_similarity dist pdist cdist trace"),
    # A norm family, not a reduction: levels that keep norms fp32 (O2) keep these too. ScaleNorm's ||h|| of
    # activations of 2100 over 1024 features is 67200: inf in fp16, every output NaN.
    *_rules("deny", "norm", "a vector norm squares and sums its inputs: past 65504 in fp16 where each input fits "
            "(kept fp32 wherever norms are)", "norm vector_norm matrix_norm frobenius_norm normalize"),
    *_rules("deny", "reduction", "weight normalisation divides by a weight's norm over all but one dim: a reduction "
            "(autocast leaves it in its fp32 weights' dtype)", "weight_norm"),
    *_rules("deny", "resample", "interpolation weights sum many neighbours; autocast keeps it fp32",
            "interpolate upsample upsample_nearest1d upsample_nearest2d upsample_nearest3d "
            "upsample_linear1d upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d grid_sample "
            "grid_sampler affine_grid"),
    *_rules("deny", "linalg", "decompositions and solves are ill-conditioned in low precision",
            "inverse det logdet slogdet solve cholesky qr svd eig eigh lstsq pinverse matrix_exp"),
    # not numerics: a call of a graph converted on its own; its inputs and outputs keep the recorded dtypes at every
    # level (rules.py: AS_RECORDED_FAMILIES), which is what the body was converted for
    *_rules("deny", "subgraph", "calls a graph converted on its own (torch.utils.checkpoint's body, dynamo's wrap): "
            "the body decides its ops' precision; its inputs and outputs keep their recorded dtypes",
            "tag_activation_checkpoint wrap"),
    *_rules("deny", "spectral", "FFT sums all inputs per output", "fft rfft irfft fft2 ifft stft istft"),
    *_rules("deny", "reduction", "counts values into bins (tokens per expert): a rounded value can cross a bin edge, "
            "and counts past 256 are not bf16 numbers", "histc bincount"),
    *_rules("deny", "scatter", "accumulating scatters add many values into one slot",
            "index_add scatter_add scatter_reduce index_reduce embedding_bag segment_reduce"),
    # --- infer: pointwise math that is fine in low precision when the inputs already are.
    *_rules("infer", "arithmetic", "pointwise arithmetic: exact up to rounding of its inputs",
            "add sub mul div true_divide neg rsub addcmul addcdiv lerp square sqrt clamp clip "
            "clamp_min clamp_max floordiv floor_divide mod remainder fmod"),
    *_rules("infer", "arithmetic", "differences of neighbours: a subtraction, exact up to rounding of its inputs",
            "diff"),
    *_rules("infer", "activation", "bounded or piecewise-linear activation: no overflow from fp16 inputs",
            "gelu silu sigmoid tanh hardtanh hardsigmoid hardswish mish elu selu celu leaky_relu "
            "logsigmoid softsign tanhshrink erf erfc"),
    *_rules("infer", "pooling", "averages a small window: safe when inputs are low precision",
            "avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d"),
    *_rules("infer", "average", "an average cannot exceed its inputs' magnitude (no overflow) and torch's CPU and "
            "CUDA kernels sum low-precision inputs in fp32; as a global average pool is, and autocast leaves it "
            "in its input's dtype", "mean"),
    *_rules("infer", "trig", "bounded trigonometric functions", "sin cos atan atan2"),
    # --- clear: data movement and selection, numerically neutral.
    *_rules("clear", "shape", "moves values without changing them",
            "view reshape flatten unflatten squeeze unsqueeze transpose permute t contiguous expand "
            "expand_as repeat tile narrow select slice getitem split chunk unbind cat concat concatenate stack "
            "hstack vstack flip roll movedim swapaxes unfold pad pixel_shuffle pixel_unshuffle "
            "channel_shuffle clone detach alias view_as reshape_as index_select gather take masked_select "
            "index take_along_dim diagonal tril triu meshgrid"),
    *_rules("clear", "selection", "picks or zeroes values without arithmetic",
            "relu relu6 threshold hardshrink softshrink max min amax amin maximum minimum max_pool1d "
            "max_pool2d max_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d where "
            "masked_fill dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout "
            "identity abs sign sort topk kthvalue median nan_to_num scatter index_put index_copy "
            "masked_scatter zeros_like ones_like full_like empty_like rand_like randn_like round floor ceil trunc"),
    *_rules("clear", "control_flow", "picks one branch's values; the ops inside each branch are painted one by one",
            "cond"),
    # --- ignore: outputs are not floating tensors, or the op reads only metadata.
    *_rules("ignore", "metadata", "reads shape or dtype only; no floating output",
            "size dim numel shape getattr ndim ndimension is_floating_point is_contiguous stride "
            "sym_size sym_numel sym_stride device"),
    *_rules("ignore", "metadata", "arithmetic on symbolic sizes (torch.export): integers, not tensors",
            "sym_min sym_max sym_not sym_float sym_int sym_ite sym_sum sym_sqrt"),
    *_rules("ignore", "assertion", "checks a value, shape or dtype the graph was captured with and returns nothing "
            "to compute with: no math", "assert assert_is_none assert_async assert_scalar assert_tensor_metadata "
            "functional_assert_async functional_assert_scalar check check_is_size sym_constrain_range "
            "sym_constrain_range_for_size functional_sym_constrain_range functional_sym_constrain_range_for_size "
            "make_dep_token"),
    *_rules("ignore", "comparison", "boolean output: nothing to cast",
            "eq ne lt le gt ge isnan isinf isfinite logical_and logical_or logical_not logical_xor "
            "and_ or_ xor invert not_ bitwise_and bitwise_or bitwise_not bitwise_xor equal allclose any all"),
    *_rules("ignore", "indices", "bit shifts of integers: integer output, nothing to cast",
            "lshift rshift bitwise_left_shift bitwise_right_shift"),
    *_rules("ignore", "indices", "integer output: nothing to cast",
            "argmax argmin argsort nonzero bucketize searchsorted arange one_hot long int bool"),
    *_rules("ignore", "embedding", "a table lookup: the output takes the dtype of the weight it reads",
            "embedding"),
    *_rules("ignore", "factory", "creates a tensor from nothing: its dtype= argument (default fp32) is kept",
            "zeros ones full empty rand randn eye linspace logspace tensor scalar_tensor"),
    *_rules("ignore", "user_cast", "an explicit dtype conversion written by the user is respected",
            "to float double half bfloat16 type type_as"),
    *_rules("ignore", "opaque", "code torch.fx cannot see into (or a custom autograd.Function): runs as written "
            "as one unit, inputs uncast (it may write into them)", "opaque_call"),
    *_rules("ignore", "guards", "checks that a call fits what the graph was specialised to: no math", "guards"),
    *_rules("ignore", "metadata", "the module's train/eval flag, read at run time", "training_flag"),
    *_rules("ignore", "metadata", "a dropout probability that follows the train flag (torch.export baked it): a "
            "Python float, no tensor", "dropout_p_when_training"),
    *_rules("ignore", "control_flow", "loop-carried values keep their dtype across iterations; the body's ops are "
            "painted and cast inside the body", "while_loop scan"),
]

# bf16 has fp32's exponent range, so ops denied only for fp16 overflow can follow their inputs.
BF16_OVERLAY = {
    "pow": ("infer", "bf16 reaches 3e38: x**p no longer overflows at fp16's 65504"),
    "exp2": ("infer", "bf16 reaches 3e38: no overflow at fp16's exp2(16)"),
    "interpolate": ("infer", "bf16 range makes the weighted neighbour sum safe; autocast-CPU lowers it"),
    "upsample_nearest2d": ("infer", "selection only; bf16 range makes it safe"),
    "upsample_bilinear2d": ("infer", "four-term weighted sum; bf16 range makes it safe"),
}


# Ops a device has no low-precision kernel for: device type -> op -> (the low dtypes it lacks, why). Applied
# (rules.py) after the level, so no level runs them low there; the user's own op lists still win.
# tests/passes/test_policy_kernel_coverage.py calls every op the table lets run low on CPU in each dtype to keep this true.
def _no_kernel(dtypes: tuple[str, ...], reason: str, ops: str) -> dict[str, tuple[tuple[str, ...], str]]:
    return {op: (dtypes, reason) for op in ops.split()}


_LOW = ("float16", "bfloat16")
DEVICE_OVERLAYS = {
    "cpu": {
        **_no_kernel(_LOW, "no CPU kernel in {dtype} (autocast-CPU keeps avg_pool3d fp32)", "avg_pool3d"),
        **_no_kernel(_LOW, "computed with avg_pool3d, which has no CPU kernel in {dtype}", "local_response_norm"),
        **_no_kernel(_LOW, "no CPU kernel in {dtype}: LAPACK works in float and double only",
                     "inverse det logdet slogdet solve cholesky qr svd eig eigh lstsq pinverse nuclear_norm"),
        **_no_kernel(_LOW, "no CPU kernel in {dtype}: the CPU FFT libraries take float and double only",
                     "fft ifft rfft irfft fft2 stft"),
        **_no_kernel(_LOW, "no CPU kernel in {dtype}",
                     "cdist pdist multi_margin_loss multilabel_margin_loss ctc_loss"),
    },
}


def device_kept_fp32(op: str, low_dtype_name: str, devices=()) -> str | None:
    """Why `op` stays fp32 on one of `devices` (device types) in `low_dtype_name`, or None."""
    for device in devices:
        dtypes, reason = DEVICE_OVERLAYS.get(device, {}).get(op, ((), ""))
        if low_dtype_name in dtypes:
            return f"{device}: {reason.format(dtype=low_dtype_name)}"
    return None


def _build(rules: list[OpRule]) -> MappingProxyType:
    table: dict[str, OpRule] = {}
    for rule in rules:
        if rule.op_class not in CLASSES:
            raise ValueError(f"op policy: {rule.op!r} has unknown class {rule.op_class!r}")
        if rule.op in table:
            raise ValueError(f"op policy: {rule.op!r} is listed twice ({table[rule.op].op_class}, {rule.op_class})")
        table[rule.op] = rule
    return MappingProxyType(table)


POLICY = _build(_TABLE)


def policy_for(low_dtype_name: str, devices=()) -> dict[str, OpRule]:
    """The table for one low-precision dtype ("float16" or "bfloat16"), overlay applied; with `devices`
    (device types, "cpu"), ops those devices have no kernel for in that dtype are denied."""
    table = dict(POLICY)
    if low_dtype_name == "bfloat16":
        for op, (op_class, reason) in BF16_OVERLAY.items():
            table[op] = OpRule(op, op_class, table[op].family, reason)
    for op, rule in table.items():
        reason = device_kept_fp32(op, low_dtype_name, devices)
        if reason is not None and rule.op_class != "ignore":
            table[op] = OpRule(op, "deny", rule.family, reason)
    return table


def default_lists(op_class: str, low_dtype_name: str = "float16") -> list[str]:
    """Sorted op names of one class, as the seeds' get_white_list()/get_black_list() return."""
    return sorted(op for op, rule in policy_for(low_dtype_name).items() if rule.op_class == op_class)
