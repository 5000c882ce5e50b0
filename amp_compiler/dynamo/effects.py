"""undone_effects: a call made at conversion (example inputs, calibration samples) leaves the model as it was."""
from __future__ import annotations

import torch
from torch import nn


class undone_effects:
    """Buffers (batch-norm statistics, counters) and fp8 amax histories as they were before a conversion-time
    call: the example inputs' amax must not be the first entry training's delayed scales are taken from."""

    def __init__(self, model: nn.Module, stores: list):
        self.model, self.stores = model, stores   # stores: history_stores(model), (prefix, Fp8HistoryStore) pairs

    def __enter__(self):
        self.saved = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.histories = [store.tensors for _, store in self.stores]   # live: keys a graph adds meanwhile too
        self.saved_histories = [{key: {name: t.clone() for name, t in tensors.items()}
                                 for key, tensors in histories.items()} for histories in self.histories]

    def __exit__(self, *exc):
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
            for histories, saved_histories in zip(self.histories, self.saved_histories):
                for key, tensors in histories.items():   # made by this call's graphs: empty, as a fresh one
                    for name, tensor in tensors.items():
                        saved = saved_histories.get(key, {}).get(name)
                        tensor.copy_(saved) if saved is not None else tensor.zero_()
