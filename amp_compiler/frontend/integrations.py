"""What well-known model libraries need before torch.export can capture their models.

Only libraries the user has already imported are touched; none of them is a dependency.
"""
from __future__ import annotations

import sys

from torch import nn


def prepare_for_export(model: nn.Module) -> list[str]:
    """Register the pytree types a model returns (Hugging Face caches); returns notes for the report."""
    notes = []
    transformers = sys.modules.get("transformers")
    if transformers is not None and any(isinstance(m, transformers.PreTrainedModel) for m in model.modules()):
        from transformers.integrations.executorch import register_dynamic_cache_export_support
        register_dynamic_cache_export_support()   # GPT-2, Llama, ... return a DynamicCache with use_cache
        notes.append("Hugging Face model: DynamicCache registered as a pytree type for torch.export")
    return notes
