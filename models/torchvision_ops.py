"""Make the torchvision wheel that matches the torch pin importable with the CPU build of torch.

The torchvision 0.28 wheel on PyPI is a CUDA build whose C extension does not load beside the CPU torch,
and its import then fails registering fake kernels for `torchvision::nms` / `qnms`, ops that do not exist.
The models themselves are pure Python. This defines the two schemas (with a small CPU nms, enough for the
detection models' post-processing on tiny inputs) before torchvision is imported. Import this module
before `import torchvision` (or call `import_torchvision()`); it does nothing when the real extension is present.
"""
from __future__ import annotations

import glob
import importlib.util
import os

import torch

_LIBRARY = None


def _nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    order = scores.argsort(descending=True)
    keep = []
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    for rank, index in enumerate(order.tolist()):
        if suppressed[rank]:
            continue
        keep.append(index)
        rest = order[rank + 1:]
        top_left = torch.maximum(boxes[index, :2], boxes[rest, :2])
        bottom_right = torch.minimum(boxes[index, 2:], boxes[rest, 2:])
        inter = (bottom_right - top_left).clamp(min=0).prod(dim=1)
        iou = inter / (area[index] + area[rest] - inter)
        suppressed[rank + 1:] |= iou > iou_threshold
    return torch.tensor(keep, dtype=torch.int64)


def _extension_loads() -> bool:
    """Whether torchvision's C extension loads beside this torch (a matching CUDA machine: it does)."""
    spec = importlib.util.find_spec("torchvision")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for library in glob.glob(os.path.join(folder, "_C*.so")):
            try:
                torch.ops.load_library(library)
                return True
            except (OSError, RuntimeError):
                return False
    return False


def register_missing_ops() -> bool:
    """Define torchvision::nms and ::qnms when the C extension cannot provide them; True if it did."""
    global _LIBRARY
    if _LIBRARY is not None or hasattr(torch.ops.torchvision, "nms") or _extension_loads():
        return False
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.impl("nms", _nms, "CPU")
    return True


def import_torchvision():
    """`import torchvision` on the CPU torch build: missing schemas defined, the nms op check relaxed."""
    register_missing_ops()
    import torchvision
    import torchvision.ops.boxes
    if _LIBRARY is not None:  # boxes.nms refuses to run without the C extension, though the op now exists
        torchvision.ops.boxes._assert_has_ops = lambda: None
    return torchvision


register_missing_ops()
