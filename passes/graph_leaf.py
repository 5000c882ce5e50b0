"""graph_leaf: a function the passes call from generated code, kept as one node when fx traces it.

torch.load re-creates a GraphModule by tracing its generated code again; torch.fx.wrap only covers
calls by the wrapped name inside the module that wrapped it, so without this the re-trace would run
the function's body on proxies (amp_cast would silently become a no-op).
"""
from __future__ import annotations

import functools

import torch.fx as fx


def graph_leaf(fn):
    @functools.wraps(fn)
    def leaf(*args, **kwargs):
        proxies: list = []
        fx.node.map_aggregate((args, kwargs), lambda v: proxies.append(v) if isinstance(v, fx.Proxy) else None)
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", leaf, args, kwargs)
        return fn(*args, **kwargs)
    return leaf
