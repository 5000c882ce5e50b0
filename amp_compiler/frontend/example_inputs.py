"""example_inputs checked against the model's forward() before capture: a wrong count is a TypeError naming
both counts, not a graph whose values silently go unpropagated. What the inputs hold (dtype, shape) is
checked where the graph is known: passes/fx/propagate_values.py. A call seen with keywords becomes positional
example_inputs (positional_inputs):

    encoder(input_ids=ids, attention_mask=mask)   ->   example_inputs=(ids, mask)
"""
from __future__ import annotations

import inspect

from torch import nn

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_input_count(model: nn.Module, example_inputs: tuple | None) -> None:
    if example_inputs is None:
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):   # a forward without a signature (a C extension): nothing to check
        return
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    keyword_only = [p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY
                    and p.default is inspect.Parameter.empty]
    given = len(example_inputs)
    if given > len(positional) or given < len(required) or keyword_only:
        takes = f"{len(required)}" if len(required) == len(positional) else f"{len(required)} to {len(positional)}"
        names = ", ".join(p.name for p in positional) + (f"; keyword-only {', '.join(keyword_only)}" if keyword_only else "")
        raise TypeError(f"example_inputs has {given} input(s) but {type(model).__name__}.forward takes {takes} "
                        f"positional input(s) ({names})")


def positional_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The call `module(*args, **kwargs)` as positional example_inputs: each keyword in its parameter's place,
    the defaults in the gaps (convert_children converts a child with the call it really got). None when it has
    no positional form: a keyword-only parameter, a keyword that only **kwargs takes, extra *args."""
    if not kwargs:
        return tuple(args)
    try:
        signature = inspect.signature(module.forward)
        passed = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    empty_var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if any(p.kind not in _POSITIONAL and p.name in passed and not (p.kind in empty_var and not passed[p.name])
           for p in params):
        return None
    positional = [p for p in params if p.kind in _POSITIONAL]
    last = max(i for i, p in enumerate(positional) if p.name in passed)
    return tuple(passed[p.name] if p.name in passed else p.default for p in positional[:last + 1])
