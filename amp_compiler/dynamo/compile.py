"""amp_compiler.compile(model, level): mixed precision on torch.compile's capture, the user's model kept."""
from __future__ import annotations

import functools
import types

import torch
from torch import nn

from amp_compiler.config import make_config, with_model_lists
from amp_compiler.dynamo.backend import amp_backend


def compile(model: nn.Module, level: str = "O1", *, backend: str = "inductor", dynamic=None,  # noqa: A001
            weight_cache: bool = True, **overrides) -> nn.Module:
    """Compile `model` in place with torch.compile, each captured graph converted by `level`'s rules first.

    It is what `model.compile(backend=...)` (nn.Module.compile) does: the same object comes back, with its class,
    `generate`, `save_pretrained` and state_dict; only its calls go through dynamo. backend="eager": the rewritten
    graphs run as fx code; "inductor": they are compiled by inductor in the same compilation. Options are
    convert()'s (dtype=torch.bfloat16, ...). Graphs are made on calls (graph breaks and recompiles are dynamo's);
    amp_compiler.dynamo.graphs(model) lists them, each one explain()-able. `weight_cache` (backend="eager"):
    inference calls reuse each weight's low copy while it is unchanged (dynamo/weight_cache.py); False casts
    every weight on every call, as autocast outside a region does. Undo with `model._compiled_call_impl =
    None` (torch's own way) or compile again.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp_compiler.compile takes an nn.Module; got {type(model).__name__} "
                        "(for a function, torch.compile(fn, backend=amp_compiler.dynamo.amp_backend(config)))")
    config = with_model_lists(make_config(level, **overrides), model)   # _keep_in_fp32_modules read once, here
    compiled = torch.compile(_frame_of_its_own(), backend=amp_backend(config, backend=backend, model=model,
                                                                    weight_cache=weight_cache),
                             dynamic=dynamic)
    # nn.Module.compile's own slot (Module.__call__ runs it); not model.compile(): dynamo skips the compiled
    # Module._call_impl frame of a torch.nn class (an nn.Sequential made no graph), a frame of this file it traces.
    model._compiled_call_impl = functools.partial(compiled, model)
    return model


def _module_call(module: nn.Module, *args, **kwargs):
    """The frame dynamo captures: the module's call with its hooks (nn_module_stack paths start L['module'])."""
    return module._call_impl(*args, **kwargs)


def _frame_of_its_own():
    """_module_call on a code object of its own: dynamo caches graphs per code object and stops compiling one after
    its recompile limit (8), so one code object shared by every compiled model left the ninth model uncompiled."""
    code = _module_call.__code__.replace()
    return types.FunctionType(code, _module_call.__globals__, _module_call.__name__)
