"""Trace one whole training step into a single fx graph of ATen ops, with the loss-scaling nodes marked.

    out = converted_gm(*inputs)                      # the converted forward, its casts included
    loss = loss_fn(fp32(out), fp32(label))           # the loss in fp32, as MindSpore does
    scaled = loss * loss_scale                       # meta["amp_role"] = "loss_scale"
    grads = d(scaled)/d(params)                      # the backward, traced by autograd
    inv_scale = reciprocal(loss_scale)               # meta["amp_role"] = "unscale"
    grad_i = grad_i * inv_scale                      #   (one per gradient)
    found_inf = not isfinite(sum_i sum(grad_i))      # meta["amp_role"] = "overflow_check"
    return loss, found_inf, *grads

The graph is traced with fake tensors (no compute, no draw from the RNG) and specialised to the input
shapes and to the modules' train/eval flags; the caller keys its cache on both. Dropout stays a random
op in the graph, so every run draws fresh masks from the global RNG exactly as eager PyTorch does.
Parameters and buffers are graph inputs; the graph writes no parameter, and the buffers it updates in
place (BatchNorm statistics) are listed in `JointGraph.mutated_state` so the caller can restore them.

Strides: a fake kernel need not return the strides the real one does. Batch norm's fake output keeps its
input's layout (a transposed (4, 64, 7) input: strides (448, 1, 64)) where the CPU kernel returns it contiguous
((448, 7, 1)), and the ops recorded after it were traced for the fake strides: a `view` that was legal on them
fails at run time. Each output of the kernels in STRIDES_NOT_TRACED is therefore given the recorded strides
when the real ones differ (`with_traced_strides`: one copy of that tensor, none when they agree), so every op
after it runs on the layout it was traced for.

A model whose Python reads tensor values (`if h.sum() > 0`, `int(batch.max())`: PyG's pooling without a size)
cannot be traced with fake tensors: `eager_step` runs the same step (fp32 loss, scaled gradients by
torch.autograd.grad, unscale, overflow check) eagerly on every call, with the same inputs and outputs.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

aten = torch.ops.aten
LOW_FLOATS = (torch.float16, torch.bfloat16)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# Kernels whose fake (meta) implementation keeps the input's layout where the real CPU/CUDA kernel returns
# another: their outputs get the traced strides at run time (with_traced_strides).
STRIDES_NOT_TRACED = tuple(getattr(aten, name).default for name in (
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "_batch_norm_with_update",
    "_batch_norm_no_update", "batch_norm_backward", "cudnn_batch_norm", "cudnn_batch_norm_backward",
    "miopen_batch_norm", "miopen_batch_norm_backward") if hasattr(aten, name))
# Errors of a fake-tensor trace through Python that reads tensor values: the step runs eagerly instead.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
# Kernels that update BatchNorm running statistics in place without saying so in their schema:
# op -> (indices of running_mean and running_var, index of the `training` flag).
UNDECLARED_MUTATIONS = {
    aten.native_batch_norm.default: ((3, 4), 5),
    aten.cudnn_batch_norm.default: ((3, 4), 5),
    aten.miopen_batch_norm.default: ((3, 4), 5),
}


@dataclass
class JointGraph:
    graph_module: fx.GraphModule
    trainable: list[str]             # parameters differentiated, in placeholder order
    grad_names: list[str]            # the trainable parameters the loss depends on: one gradient each
    state_names: list[str]           # every parameter and buffer, in placeholder order after `trainable`
    mutated_state: list[str]         # of trainable + state_names: tensors the graph writes in place


def trace_joint_graph(module: torch.nn.Module, loss_fn, trainable: dict[str, torch.Tensor],
                      state: dict[str, torch.Tensor], inputs: tuple, label) -> JointGraph:
    """Trace forward + fp32 loss + scaled backward + unscale + overflow check of `module` into one graph.

    `trainable` are differentiated; `state` (other parameters, buffers) are read as they are. Tensor
    leaves of `inputs` and `label` become placeholders; anything else is baked into the graph.
    """
    trainable_names, state_names = list(trainable), list(state)
    leaves, tree = pytree.tree_flatten((inputs, label))
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    label_leaf_start = len(pytree.tree_leaves(inputs))
    single_label = isinstance(label, torch.Tensor)
    grad_names: list[str] = []

    def joint_step(*flat):
        params = flat[:len(trainable_names)]
        rest = flat[len(trainable_names):len(trainable_names) + len(state_names)]
        tensors = flat[len(trainable_names) + len(state_names):-1]
        loss_scale = flat[-1]
        values = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            values[position] = tensor
        step_inputs, step_label = pytree.tree_unflatten(values, tree)
        parameters_and_buffers = {**dict(zip(trainable_names, params)), **dict(zip(state_names, rest))}
        # What torch.func.functional_call does, held open through the backward too: a backward that
        # recomputes by calling the modules again (reentrant activation checkpointing) must see the
        # trace's parameters, not the real ones (it would write fake gradients into the real .grad).
        with _reparametrize_module(module, parameters_and_buffers, tie_weights=True):
            output = module(*step_inputs)
            loss = _scalar_loss(loss_fn(_to_fp32(output), _to_fp32(step_label)))
            scaled_loss = loss * loss_scale
            grads = _gradients(scaled_loss, params)
        return _unscaled_step_outputs(loss, loss_scale, trainable_names, grads, grad_names)

    flat_args = [*trainable.values(), *state.values(), *(leaves[i] for i in tensor_positions),
                 torch.ones((), dtype=torch.float32)]
    with torch.enable_grad():
        gm = make_fx(joint_step, tracing_mode="fake", _allow_non_fake_inputs=True)(*flat_args)
    gm.graph.eliminate_dead_code()
    restride_untraced_outputs(gm.graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_names = [_input_name(i, label_leaf_start, single_label) for i in tensor_positions]
    _rename_placeholders(placeholders, [*(f"p_{n}" for n in trainable_names), *(f"s_{n}" for n in state_names),
                                        *input_names, "loss_scale"])
    mark_step_roles(gm.graph, placeholders[-1])
    owners = dict(zip(placeholders, [*trainable_names, *state_names]))
    mutated = sorted({owners[n] for n in mutated_inputs(gm.graph) if n in owners},
                     key=[*trainable_names, *state_names].index)
    gm.graph.lint()
    gm.recompile()
    gm.meta["amp_step"] = {"gradients": list(grad_names), "restored_on_overflow": mutated}
    return JointGraph(gm, trainable_names, list(grad_names), state_names, mutated)


def _unscaled_step_outputs(loss, loss_scale, trainable_names: list[str], grads, grad_names: list[str]) -> tuple:
    """(loss, found_inf, *unscaled gradients); grad_names is set, in place, to the parameters that have one."""
    used = [(name, grad) for name, grad in zip(trainable_names, grads) if grad is not None]
    grad_names[:] = [name for name, _ in used]
    inv_scale = torch.reciprocal(loss_scale)
    # A weight stored low (train/low_weights.py) has a low gradient: times a 1-element fp32 tensor (0-dim
    # would not promote) it comes out fp32 in one pass, not cast and then multiplied.
    inv_scale_promoting = inv_scale.reshape(1)
    unscaled = [grad * inv_scale_promoting if grad.dtype in LOW_FLOATS and grad.dim() > 0
                else _to_fp32(grad) * inv_scale for _, grad in used]
    if unscaled:
        # A sum is inf/nan when a term is (inf - inf gives nan); finite terms overflow it only beyond
        # 3.4e38, also an overflow. One vectorised pass per gradient: ~25x cheaper than max(|g|).
        total = torch.stack([g.sum() for g in unscaled]).sum()
        found_inf = torch.logical_not(torch.isfinite(total))
    else:
        found_inf = torch.zeros((), dtype=torch.bool)
    return (loss.detach(), found_inf, *unscaled)


class EagerStep:
    """The joint graph's step run eagerly, for a model fake tensors cannot trace (`reason`): called with the
    joint graph's inputs (trainable, state, input tensors, loss scale) it returns its outputs. The trainable
    tensors are the module's own, so the module is called as it is; gradients come from torch.autograd.grad
    (nothing is written into .grad: the caller writes the masters')."""

    def __init__(self, module, loss_fn, trainable_names: list[str], state_names: list[str], inputs: tuple, label,
                 reason: str) -> None:
        self.module, self.loss_fn, self.reason = module, loss_fn, reason
        self.trainable_names, self.state_names = trainable_names, state_names
        leaves, self._tree = pytree.tree_flatten((inputs, label))
        self._leaves = leaves
        self._positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.grad_names: list[str] = list(trainable_names)   # set on each call: the parameters that had a gradient
        self.meta = {"amp_step": {"eager": reason}}

    @property
    def code(self) -> str:
        return f"# this step runs eagerly, not as one graph: {self.reason}\n"

    def __call__(self, *flat):
        params = flat[:len(self.trainable_names)]
        tensors, loss_scale = flat[len(self.trainable_names) + len(self.state_names):-1], flat[-1]
        values = list(self._leaves)
        for position, tensor in zip(self._positions, tensors):
            values[position] = tensor
        inputs, label = pytree.tree_unflatten(values, self._tree)
        with torch.enable_grad():
            loss = _scalar_loss(self.loss_fn(_to_fp32(self.module(*inputs)), _to_fp32(label)))
            reached = [p for p in params if p.requires_grad]
            found = iter(torch.autograd.grad(loss * loss_scale, reached, allow_unused=True)
                         if reached and loss.requires_grad else [None] * len(reached))
        grads = [next(found) if p.requires_grad else None for p in params]
        return _unscaled_step_outputs(loss, loss_scale, self.trainable_names, grads, self.grad_names)


def eager_step(module, loss_fn, trainable: dict[str, torch.Tensor], state: dict[str, torch.Tensor], inputs: tuple,
               label, reason: str) -> JointGraph:
    """A JointGraph whose graph_module is an EagerStep; every buffer counts as written (an overflow puts back
    all of them: the step cannot tell which the forward updates)."""
    step = EagerStep(module, loss_fn, list(trainable), list(state), inputs, label, reason)
    buffers = [name for name, tensor in state.items() if not isinstance(tensor, torch.nn.Parameter)]
    return JointGraph(step, list(trainable), step.grad_names, list(state), buffers)


def with_traced_strides(tensor: torch.Tensor, size: tuple, stride: tuple) -> torch.Tensor:
    """`tensor` with the strides the trace recorded for it: itself when they agree, else a copy laid out so."""
    if tensor.stride() == stride:
        return tensor
    return tensor.new_empty_strided(size, stride).copy_(tensor)


def restride_untraced_outputs(graph: fx.Graph) -> int:
    """After each tensor output of a STRIDES_NOT_TRACED kernel, with_traced_strides(out, recorded size, stride);
    returns how many were inserted."""
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in STRIDES_NOT_TRACED:
            continue
        outputs = [user for user in node.users if user.target is operator.getitem] \
            if isinstance(node.meta.get("val"), (tuple, list)) else [node]
        for output in outputs:
            value = output.meta.get("val")
            if not isinstance(value, torch.Tensor) or not output.users:
                continue
            with graph.inserting_after(output):
                restrided = graph.call_function(with_traced_strides, (output, tuple(value.shape), value.stride()))
            output.replace_all_uses_with(restrided, delete_user_cb=lambda user: user is not restrided)
            restrided.meta["val"] = value
            inserted += 1
    return inserted


def _gradients(scaled_loss: torch.Tensor, params: tuple) -> list:
    """d(scaled_loss)/d(params), None for a parameter the loss does not reach. Through backward() into
    .grad rather than autograd.grad(): reentrant activation checkpointing (use_reentrant=True) refuses
    to run under autograd.grad(); the params here are the trace's own leaves, so nothing else is touched."""
    if not params:
        return []
    for param in params:
        param.grad = None
    if scaled_loss.requires_grad:
        scaled_loss.backward()
    grads = [param.grad for param in params]
    for param in params:
        param.grad = None
    return grads


def mark_step_roles(graph: fx.Graph, loss_scale: fx.Node) -> None:
    """Write meta["amp_role"]: "loss_scale" on the multiplications by the scale (the forward product and
    its backward seed), "unscale" on 1/scale and the products by it, "overflow_check" on the nodes that
    reduce the unscaled gradients to found_inf, "cast" on dtype conversions."""
    reciprocal = [u for u in loss_scale.users if u.target is aten.reciprocal.default]
    scaling = [u for u in loss_scale.users if u not in reciprocal]
    unscaling = reciprocal + [u for r in reciprocal for u in r.users]
    unscaling += [u for v in list(unscaling) if v.target in VIEWS for u in v.users]   # via inv_scale.reshape(1)
    output = next(n for n in graph.nodes if n.op == "output")
    found_inf = output.args[0][1]
    upstream_of_grads = _ancestors(unscaling) | set(unscaling)
    for node in scaling:
        node.meta["amp_role"] = "loss_scale"
    for node in unscaling:
        node.meta["amp_role"] = "unscale"
    for node in _ancestors([found_inf]) | {found_inf}:
        if node not in upstream_of_grads:
            node.meta["amp_role"] = "overflow_check"
    for node in graph.nodes:
        if node.target is aten._to_copy.default and "dtype" in node.kwargs and "amp_role" not in node.meta:
            node.meta["amp_role"] = "cast"
    if not scaling or not unscaling:
        raise RuntimeError("internal error: the traced step has no loss-scale or unscale node")


def mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Placeholders some node writes in place: declared by the op's schema (add_, copy_, ...) or by
    UNDECLARED_MUTATIONS (BatchNorm running statistics in training mode); views are followed to their base."""
    written: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
                written.add(_base_of(value))
        if node.target in UNDECLARED_MUTATIONS:
            stat_indices, training_index = UNDECLARED_MUTATIONS[node.target]
            if len(node.args) > training_index and node.args[training_index]:
                written.update(_base_of(node.args[i]) for i in stat_indices)
    return {n for n in written if isinstance(n, fx.Node) and n.op == "placeholder"}


def _base_of(value):
    """Follow views and in-place results (outputs that alias an input) back to the tensor they alias."""
    while isinstance(value, fx.Node) and value.op == "call_function" and \
            isinstance(value.target, torch._ops.OpOverload) and value.target._schema.returns and \
            value.target._schema.returns[0].alias_info is not None and value.args:
        value = value.args[0]
    return value


def _ancestors(nodes) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _scalar_loss(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar loss (one element) to train on, got a tensor of shape "
                         f"{tuple(loss.shape)}: reduce it, e.g. with .mean() or reduction='mean'")
    if not loss.is_floating_point():
        raise ValueError(f"loss_fn must return a floating-point loss, got {loss.dtype}")
    return loss.reshape(())


def _to_fp32(tree):
    return pytree.tree_map(lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in LOW_FLOATS else v,
                           tree)


def _input_name(leaf_index: int, label_start: int, single_label: bool) -> str:
    if leaf_index < label_start:
        return f"input_{leaf_index}"
    return "label" if single_label else f"label_{leaf_index - label_start}"


def _rename_placeholders(placeholders: list[fx.Node], names: list[str]) -> None:
    """make_fx names its inputs arg0_1, arg1_1, ...; the printed step reads better with p_fc1_weight."""
    for node, name in zip(placeholders, names, strict=True):
        readable = re.sub(r"\W", "_", name)
        node._rename(readable)
        node.target = node.name
