"""What convert(model, level, inplace=True) asks of a model around its compilation, and restore(model).

    refuse_in_place_request   no module, example_inputs that are not a tuple, low-precision parameters
    capture_now               example_inputs: one call at conversion, its effects undone (effects.py)
    load_histories            fp8 delayed amax histories a checkpoint kept apart, back into the model
    restore                   the model's own forward back, graphs and amax-history keys dropped
"""
from __future__ import annotations

import torch
from torch import nn

import warnings

from amp_compiler.converted import compiled_record
from amp_compiler.dynamo.compile import history_stores, restore_compiled
from amp_compiler.dynamo.effects import undone_effects
from amp_compiler.dynamo.fp8_histories import HISTORIES
from amp_compiler.frontend.capture import refuse_low_parameters


def refuse_in_place_request(model, example_inputs) -> None:
    """What convert(..., inplace=True) refuses before changing anything: no module, a model converted already
    (a second conversion would silently replace the first: restore it first), example_inputs that are not a tuple,
    low-precision parameters (refuse_low_parameters says why)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() needs a torch.nn.Module, got {type(model).__name__}")
    if (state := compiled_record(model)) is not None:
        raise ValueError(f"{type(model).__name__} is already converted in place (level {state.config.level}); call "
                         "amp_compiler.restore(model) first to convert it again with other options")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, "
                        f"got {type(example_inputs).__name__}")
    refuse_low_parameters(model)


def capture_now(model: nn.Module, example_inputs: tuple | None) -> None:
    """With example_inputs: one call at conversion, so the graphs exist before the first real one; its effects
    (buffers, fp8 histories) undone."""
    if example_inputs is not None:
        with undone_effects(model, history_stores(model)), torch.no_grad():
            model(*example_inputs)


def load_histories(model: nn.Module, histories: dict | None) -> None:
    """Put `histories` (pop_history_keys of a state_dict saved from `model`) back into its conversion: into the
    graphs captured so far and those captured later. Warns, rather than resume on other scales unsaid, when the
    checkpoint has none for a model converted at fp8_scaling="delayed" (they restart empty), or has some for a
    model converted otherwise (they are dropped)."""
    stores = history_stores(model)
    if not stores and histories:
        warnings.warn(f"the checkpoint holds {len(histories) // len(HISTORIES)} fp8 amax histories (fp8_scaling="
                      f"'delayed'), but {type(model).__name__} is not converted in place at that recipe: they are "
                      "dropped", UserWarning, stacklevel=3)
    elif stores and not histories:
        warnings.warn(f"{type(model).__name__} is converted at fp8_scaling='delayed', but the checkpoint holds no "
                      "fp8 amax histories (saved before they were kept, or at another level): they restart empty, "
                      "so the next scales are not the interrupted run's", UserWarning, stacklevel=3)
    if not stores or not histories:
        return
    errors: list[str] = []
    for prefix, store in stores:   # a model whose children were compiled one by one: each child's, by its path
        store.take_from_state_dict(model, dict(histories), prefix, {}, True, [], [], errors)
    if errors:
        raise RuntimeError("loading fp8 amax histories: " + "; ".join(errors))


def restore(model: nn.Module) -> nn.Module:
    """Undo convert(model, inplace=True) or amp_compiler.compile(model): the model's own forward back, its graphs
    dropped (and, at fp8 delayed scaling, its amax histories' state_dict keys)."""
    if compiled_record(model) is None:
        raise TypeError("restore() takes a model converted with convert(model, inplace=True) or compiled by "
                        f"amp_compiler.compile; {type(model).__name__} is not")
    return restore_compiled(model)
