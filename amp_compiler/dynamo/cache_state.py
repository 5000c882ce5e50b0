"""Which of a dynamo graph's outputs are a KV cache's tensors: state the model stores for its next calls, kept in
the low dtype as autocast keeps it (keep_io_types restores only what the model returns).

Dynamo records `self.keys = torch.cat([self.keys, key_states], dim=-2)` in a transformers cache layer as an
attribute mutation of that object, its value a node of the graph handed to the backend. Restored to fp32 (the
fp32 model's dtype), the cache costs twice autocast's bytes and each decode step casts all of it back to bf16 for
attention. What this relies on (torch 2.13): the backend runs while dynamo's InstructionTranslator is current, and
its output graph's side effects name each mutated object with its stored values' proxies (checked by
tests/dynamo/test_dynamo_capture.py's decode test). An encoder-decoder's cache stays fp32 (backend.py): its cross-attention
layers are read back as stored by the next step's own code, which dynamo traces as written (T5: matmul of an fp32
query with a bf16 key failed there).
"""
from __future__ import annotations

import torch.fx as fx

from amp_compiler.passes.fx.insert_casts import STATE_OUTPUT

CACHE_MODULES = ("transformers.cache_utils",)   # where the cache classes are defined


def mark_cache_state(gm: fx.GraphModule) -> int:
    """Mark (node meta STATE_OUTPUT) the nodes dynamo stores into a KV cache object; returns how many."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        translator = InstructionTranslator.current_tx()
        mutations = translator.output.side_effects.store_attr_mutations
    except Exception:  # noqa: BLE001 - not inside dynamo's compilation, or another torch: nothing is marked
        return 0
    marked = 0
    for owner, stored in mutations.items():
        cls = type(getattr(owner, "value", None))
        if not cls.__module__.startswith(CACHE_MODULES):
            continue
        for value in stored.values():
            node = _node_of(value)
            if node is not None and node.graph is gm.graph:
                node.meta[STATE_OUTPUT] = f"stored in {cls.__name__}"
                marked += 1
    return marked


def _node_of(variable) -> fx.Node | None:
    try:
        return variable.as_proxy().node
    except Exception:  # noqa: BLE001 - a constant, an object: no graph value
        return None
