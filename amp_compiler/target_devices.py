"""The devices a converted model will run on, so that no decision picks a dtype they have no kernel for.

    model parameters/buffers  ->  their device types ("the model's parameters")
    none: tensors in example_inputs  ->  their device types ("the example inputs")
    neither: torch's default device ("torch's default device")
The policy's device overlays (op_policy.DEVICE_OVERLAYS) keep fp32 what these devices cannot run low;
gm.meta["amp"]["devices"] and explain()'s first line say which devices, and from what.
"""
from __future__ import annotations

import torch
from torch import nn


def target_devices(model: nn.Module, example_inputs=None) -> tuple[tuple[str, ...], str]:
    """(sorted device types, where they were read from)."""
    tensors = [*model.parameters(), *model.buffers()]
    if tensors:
        return tuple(sorted({t.device.type for t in tensors})), "the model's parameters"
    inputs = [v for v in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(v, torch.Tensor)]
    if inputs:
        return tuple(sorted({t.device.type for t in inputs})), "the example inputs"
    return (torch.get_default_device().type,), "torch's default device"
