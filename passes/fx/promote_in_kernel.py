"""Let an fp32 add/sub/mul/div read its low input directly: the kernel upcasts, no fp32 copy is written.

    add(amp_cast(h_bf16, float32), residual_fp32)   ->   add(h_bf16, residual_fp32)
torch's type promotion computes bf16 + fp32 in fp32, converting each element as the kernel reads it; the
conversion is exact, so the result is bitwise the cast-then-add's, and autograd casts the input's gradient
back to bf16 as the cast's backward did. What goes is one tensor written and read again: a residual add
after a low block (autocast gets the same saving from the same promotion). Only where promotion gives
fp32: the other operand is an fp32 tensor with at least one dimension (a 0-dim fp32 tensor loses promotion
to a dimensioned bf16 one, a Python number always does), and the op is out of place. Runs last on fx.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from amp_compiler.passes.fx.runtime import is_cast
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import PROMOTING_OPS
from amp_compiler.passes.runner import PassResult


def binary_operands(node: fx.Node) -> list[fx.Node] | None:
    """The two tensor operands of a binary op, or None when its arguments are anything else."""
    values = [*node.args[:2], *(node.kwargs[k] for k in ("other",) if k in node.kwargs)]
    operands = [v for v in values if isinstance(v, fx.Node)]
    return operands if len(operands) == 2 else None


def promotion_partner(op: fx.Node, value: fx.Node) -> fx.Node | None:
    """The other operand of an out-of-place add/sub/mul/div that reads `value`, when that operand is a tensor
    with at least one dimension (so that, if it is fp32, type promotion makes the result fp32); else None."""
    if facts(op).get("op") not in PROMOTING_OPS or facts(op).get("inplace"):
        return None
    operands = binary_operands(op)
    if operands is None or value not in operands or operands[0] is operands[1]:
        return None
    other = operands[1] if operands[0] is value else operands[0]
    fake = other.meta.get("val")
    return other if isinstance(fake, torch.Tensor) and fake.dim() > 0 else None


def promote_in_kernel(gm: fx.GraphModule) -> PassResult:
    graph, promoted = gm.graph, 0
    for op in list(graph.nodes):
        if op.op not in ("call_function", "call_method") or facts(op).get("dtype") != torch.float32:
            continue
        for cast in [a for a in op.all_input_nodes if is_cast(a)]:
            other = promotion_partner(op, cast)
            # another upcast as the partner: one of the two must stay for the result to be fp32
            if (other is None or is_cast(other) or facts(other).get("dtype") != torch.float32 or cast.kwargs
                    or cast.args[1] != torch.float32
                    or facts(cast.args[0]).get("dtype") not in (torch.float16, torch.bfloat16)):
                continue
            source = cast.args[0]
            op.replace_input_with(cast, source)
            if not cast.users:
                graph.erase_node(cast)
            amp = facts(op)   # explain() shows why no cast feeds it
            amp["rule"] = f"{amp.get('rule', '')}; reads {source.name} uncast (type promotion)"
            promoted += 1
            break
    return PassResult(modified=promoted > 0, counts={"upcasts_left_to_the_kernel": promoted})
