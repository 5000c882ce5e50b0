"""Errors of the front end, and where in the user's code a capture broke."""
from __future__ import annotations

import os
import traceback

import torch


class TracingError(RuntimeError):
    """Neither torch.fx nor torch.export could capture the model."""


def user_frame(error: BaseException) -> str:
    """' (at file:line: code)': the deepest frame of model code (the user's or torch.nn's), the construct
    that broke tracing; tracer internals and this package are skipped."""
    torch_dir = os.path.dirname(torch.__file__)
    internals = tuple(os.path.join(torch_dir, d) for d in ("fx", "_", "export", "utils", "overrides.py",
                                                           "_tensor.py", "_ops.py"))
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    passes_dir = os.path.join(os.path.dirname(own_dir), "passes")
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(internals) and not f.filename.startswith((own_dir, passes_dir))]
    if not frames:
        frames = traceback.extract_tb(error.__traceback__)[-1:]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno}: {frame.line})"
