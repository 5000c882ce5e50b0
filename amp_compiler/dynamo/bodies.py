"""Graphs inside a dynamo graph: the body of torch.utils.checkpoint (and of dynamo's `wrap`), converted as a graph of
its own, so a checkpointed block runs mixed precision and is still recomputed in the backward.

    wrap_body_0 = self.wrap_body_0
    out = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, x, w1, b1, ..., use_reentrant=False)

Dynamo captures a checkpointed call as this higher-order op: the op runs the body under checkpoint, so the body is
where the matmuls are (the outer pipeline saw one unknown op and kept all of it fp32). The body is converted with
the outer graph's rules, its inputs and outputs in the dtypes dynamo recorded: the outer graph reads and passes
the op's values in those dtypes (op policy family "subgraph", fp32 at every level), and the body's first nodes
restore each float input's recorded dtype anyway (a no-op when it has it), so the body is right whatever reaches it.

checkpoint_sequential is on dynamo's skip list (a graph break: its segments' recomputation then ran outside the
compiled call, as written, fp32); trace_checkpoint_sequential gives dynamo a traceable copy of it, so each segment
is a checkpoint op like any other.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx
import torch.utils.checkpoint

from amp_compiler.passes.fx.runtime import amp_cast, is_float
from amp_compiler.passes.node_facts import facts

_SEQUENTIAL_TRACEABLE = []   # registered once per process, on the first compilation


def trace_checkpoint_sequential() -> None:
    """Let dynamo trace torch.utils.checkpoint.checkpoint_sequential as the checkpoint calls it makes (dynamo's
    substitute_in_graph: only its tracing reads the copy; a call outside dynamo runs torch's own). The same for
    every torch.compile of the process, which then captures the segments instead of breaking the graph there."""
    if not _SEQUENTIAL_TRACEABLE and hasattr(torch._dynamo, "substitute_in_graph"):
        torch._dynamo.substitute_in_graph(torch.utils.checkpoint.checkpoint_sequential)(_checkpoint_sequential)
        _SEQUENTIAL_TRACEABLE.append(True)


def _checkpoint_sequential(functions, segments, input, use_reentrant=None, **kwargs):
    """torch.utils.checkpoint.checkpoint_sequential (torch 2.13) as dynamo can trace it: the same segments, each
    but the last through checkpoint, the same defaults (use_reentrant None is True, with torch's warning outside
    dynamo)."""
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())

    def run_function(start, end):
        def forward(x):
            for j in range(start, end + 1):
                x = functions[j](x)
            return x
        return forward

    segment_size = len(functions) // segments
    end = -1
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        input = torch.utils.checkpoint.checkpoint(run_function(start, end), input, preserve_rng_state=preserve,
                                                  use_reentrant=True if use_reentrant is None else use_reentrant)
    return run_function(end + 1, len(functions) - 1)(input)


BODY_OPS = {torch.ops.higher_order.tag_activation_checkpoint: "checkpoint", torch.ops.higher_order.wrap: "wrap"}


def bodies(gm: fx.GraphModule) -> list[tuple[fx.Node, str, fx.GraphModule]]:
    """(the op's node, its kind, the body) for each higher-order op of `gm` that calls a body of `gm`."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in BODY_OPS and node.args:
            body = node.args[0]
            if isinstance(body, fx.Node) and body.op == "get_attr":
                found.append((node, BODY_OPS[node.target], getattr(gm, body.target)))
    return found


def convert_bodies(gm: fx.GraphModule, weight_names: dict, config,
                   convert: Callable[[fx.GraphModule, dict, object], fx.GraphModule]) -> list[str]:
    """Convert every body `gm` calls with `convert(body, its weight names, config)`; returns the bodies' names.
    weight_names: the outer graph's {placeholder: {"name", "kind"}}, handed to each body by argument position."""
    config = dataclasses.replace(config, keep_io_types=True)   # the outer graph reads the body's recorded dtypes
    converted = []
    for node, kind, body in bodies(gm):
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        names = {inner.name: weight_names[outer.name] for inner, outer in zip(placeholders, node.args[1:])
                 if isinstance(outer, fx.Node) and outer.name in weight_names}
        context_fn = body.meta.get("_checkpoint_context_fn")   # a user's selective-checkpoint policy
        body = convert(body, names, config)   # may be a new GraphModule: the op's get_attr reads it
        if context_fn is not None:
            body.meta["_checkpoint_context_fn"] = context_fn
        _restore_input_dtypes(body)
        body.meta["amp"]["body_of"] = kind
        setattr(gm, node.args[0].target, body)
        converted.append(node.args[0].target)
    return converted


def _restore_input_dtypes(body: fx.GraphModule) -> None:
    """Each float input of the body read in its recorded dtype: the op hands inputs over uncast."""
    for placeholder in [n for n in body.graph.nodes if n.op == "placeholder"]:
        value = placeholder.meta.get("val")
        if not isinstance(value, torch.Tensor) or not is_float(value.dtype) or not placeholder.users:
            continue
        with body.graph.inserting_after(placeholder):
            restored = body.graph.call_function(amp_cast, (placeholder, value.dtype))
        placeholder.replace_all_uses_with(restored, delete_user_cb=lambda user: user is not restored)
        restored.meta["val"] = value
        restored.meta["amp"] = {**facts(placeholder), "op": "amp_cast", "precision": None,
                                "rule": "body input: read in the dtype dynamo recorded (a no-op when it has it)"}
    body.recompile()


def call_bodies_directly(gm: fx.GraphModule) -> int:
    """After the passes: each higher-order op calls its converted body as the user's code did (checkpoint_body,
    wrap_body); returns how many. Its facts (op, rule) stay the op's, for explain."""
    count = 0
    for node, kind, _ in bodies(gm):
        node.target = checkpoint_body if kind == "checkpoint" else wrap_body
        count += 1
    if count:
        gm.recompile()
    return count


def checkpoint_body(body: fx.GraphModule, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint(body, *args) as the user called it (dynamo recorded the kwargs). Not the
    op's eager implementation: that interprets the body node by node and turns checkpoint's early stop off, so a
    backward recomputed every matmul of the body (a block's last linear too, which no gradient needs)."""
    context_fn = body.meta.get("_checkpoint_context_fn")
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(body, *args, **kwargs)


def wrap_body(body: fx.GraphModule, *args, **kwargs):
    """dynamo's `wrap`: a plain call of the body."""
    return body(*args, **kwargs)
