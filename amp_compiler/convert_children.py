"""When a model's own forward cannot be captured, run it as written and convert each child instead.

    SSD.forward (data-dependent NMS, Python loops over image lists)  ->  runs as written
      backbone, head                                                 ->  converted GraphModules

The result is the model's own class (a shallow copy sharing its tensors) with its children replaced by
their conversions, so its forward, methods and state_dict keys are the original's. Each child is
converted with the inputs it received in one eval-mode run of `example_inputs` (keywords put in their
positional places: encoder(input_ids=ids, attention_mask=m) -> (ids, m)), so children that need
torch.export get example inputs too, and calibrated on the inputs it received in runs of each
`calibration_data` sample. `dynamic_shapes` describes the model's inputs, not its children's: a warning
says it was not used. Children without parameters run as written.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from amp_compiler.frontend import TracingError, share_module_tree
from amp_compiler.frontend.example_inputs import positional_inputs


def record_child_inputs(root: nn.Module, samples) -> list[dict[str, tuple]]:
    """For each sample (a tuple of the model's inputs): name -> the inputs each direct child received in one
    eval-mode run (first call), keywords put in their positional places; None where they have no positional form."""
    seen: list[dict[str, tuple]] = []

    def recorder(name: str):   # keywords too (encoder(input_ids=..., attention_mask=...)): in their places
        def record(module, args, kwargs):
            seen[-1].setdefault(name, positional_inputs(module, args, kwargs))
        return record

    handles = [child.register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name, child in root.named_children()]
    training = {m: m.training for m in root.modules()}
    root.eval()   # the copy's flags only: batch norm statistics are not updated by this run
    try:
        with torch.no_grad():
            for sample in samples:
                seen.append({})
                root(*sample)
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in training.items():
            module.training = flag
    return seen


def convert_children(model: nn.Module, capture_error: TracingError, convert, level: str, example_inputs,
                     calibration_data=None, dynamic_shapes=None, **options) -> nn.Module:
    """A copy of `model` whose children with parameters are converted with `convert(child, level, ...)`."""
    root = share_module_tree(model)
    inputs, *calibration = record_child_inputs(root, [example_inputs, *(calibration_data or ())])
    children, notes = {}, [f"{type(model).__name__}.forward runs as written: {str(capture_error).splitlines()[0]}"]
    if dynamic_shapes is not None:
        warnings.warn(f"convert(): dynamic_shapes was not used: {type(model).__name__}.forward cannot be captured, "
                      "so its children are converted with the inputs they receive (each keeps the dims torch.export "
                      "allows dynamic)", UserWarning, stacklevel=3)
        notes.append("dynamic_shapes not used: it describes the model's inputs, and only its children are converted")
    for name, child in root.named_children():
        if not any(True for _ in child.parameters()):
            continue
        # a child's calibration samples: what it received in the model's run on each calibration sample
        samples = [run[name] for run in calibration if run.get(name) is not None] if inputs.get(name) else None
        try:
            converted = convert(child, level, example_inputs=inputs.get(name),
                                calibration_data=samples if calibration_data is not None else None, **options)
        except TracingError as error:
            notes.append(f"{name} runs as written: {str(error).splitlines()[0]}")
            continue
        root._modules[name] = converted
        children[name] = converted.meta["amp"]
    uncalibrated = [name for name in children if inputs.get(name) is None]
    if calibration_data is not None and uncalibrated:
        warnings.warn(f"convert(): calibration_data was not used for {', '.join(uncalibrated)}: called with keyword "
                      "arguments that have no positional form (keyword-only or **kwargs), so converted without "
                      "example inputs", UserWarning, stacklevel=3)
    if not children:
        raise capture_error
    any_child = next(iter(children.values()))
    root.meta = {"amp": {**{k: any_child[k] for k in ("level", "requested_level", "dtype", "keep_io_types",
                                                      "loss_scale_manager")},
                         "frontend": "as written, children converted", "leaf_modules": [],
                         "notes": notes, "opaque": {"": notes[0]}, "children": children,
                         "casts": sum(c["casts"] for c in children.values()), "pass_counts": {}}}
    return root
