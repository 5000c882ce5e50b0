"""When a model's own forward cannot be captured, run it as written and convert each child instead.

    SSD.forward (data-dependent NMS, Python loops over image lists)  ->  runs as written
      backbone, head                                                 ->  converted GraphModules

The result is the model's own class (a shallow copy sharing its tensors) with its children replaced by
their conversions, so its forward, methods and state_dict keys are the original's. Each child is
converted with the inputs it received in one eval-mode run of `example_inputs`, so children that need
torch.export get example inputs too. Children without parameters run as written.
"""
from __future__ import annotations

import torch
from torch import nn

from amp_compiler.frontend import TracingError, share_module_tree


def record_child_inputs(root: nn.Module, example_inputs) -> dict[str, tuple]:
    """name -> the positional inputs each direct child received in one eval-mode run (first call)."""
    if example_inputs is None:
        return {}
    seen: dict[str, tuple] = {}
    # A child called with keyword arguments is converted without example inputs: its positional ones
    # alone would be refused as too few (frontend/example_inputs.py).
    def recorder(name: str):
        def record(module, args, kwargs):
            seen.setdefault(name, None if kwargs else args)
        return record

    handles = [child.register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name, child in root.named_children()]
    training = {m: m.training for m in root.modules()}
    root.eval()   # the copy's flags only: batch norm statistics are not updated by this run
    try:
        with torch.no_grad():
            root(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in training.items():
            module.training = flag
    return seen


def convert_children(model: nn.Module, capture_error: TracingError, convert, level: str, example_inputs,
                     **options) -> nn.Module:
    """A copy of `model` whose children with parameters are converted with `convert(child, level, ...)`."""
    root = share_module_tree(model)
    inputs = record_child_inputs(root, example_inputs)
    children, notes = {}, [f"{type(model).__name__}.forward runs as written: {str(capture_error).splitlines()[0]}"]
    for name, child in root.named_children():
        if not any(True for _ in child.parameters()):
            continue
        try:
            converted = convert(child, level, example_inputs=inputs.get(name), **options)
        except TracingError as error:
            notes.append(f"{name} runs as written: {str(error).splitlines()[0]}")
            continue
        root._modules[name] = converted
        children[name] = converted.meta["amp"]
    if not children:
        raise capture_error
    any_child = next(iter(children.values()))
    root.meta = {"amp": {**{k: any_child[k] for k in ("level", "requested_level", "dtype", "keep_io_types",
                                                      "loss_scale_manager")},
                         "frontend": "as written, children converted", "leaf_modules": [],
                         "notes": notes, "opaque": {"": notes[0]}, "children": children,
                         "casts": sum(c["casts"] for c in children.values()), "pass_counts": {}}}
    return root
