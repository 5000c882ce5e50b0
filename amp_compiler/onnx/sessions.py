"""ONNX Runtime sessions on the best usable device, silent on CPU-only machines.

    execution_providers()  ->  ["CUDAExecutionProvider", "CPUExecutionProvider"]   when a CUDA GPU is usable
                           ->  ["CPUExecutionProvider"]                            otherwise

onnxruntime-gpu lists CUDAExecutionProvider even without a GPU, and asking for it there logs an error
before falling back; so CUDA is requested only when ONNX Runtime offers it AND torch can see a device.
"""
from __future__ import annotations

import os

import onnxruntime as ort

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def cuda_usable() -> bool:
    import torch   # imported here: the ONNX passes themselves do not need torch
    return torch.cuda.is_available()


def execution_providers() -> list[str]:
    if CUDA in ort.get_available_providers() and cuda_usable():
        return [CUDA, CPU]
    return [CPU]


def make_session(model, *, providers: list[str] | None = None) -> ort.InferenceSession:
    """A session for an ONNX path (or serialized bytes); ORT logs only errors."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = os.fspath(model) if isinstance(model, (str, os.PathLike)) else model
    return ort.InferenceSession(source, sess_options=options, providers=providers or execution_providers())
