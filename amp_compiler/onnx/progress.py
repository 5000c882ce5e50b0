"""A progress bar for the ONNX entry points (convert_onnx, export_onnx): one step per stage or pass, the
save's tensors ticking by; shown only when the work takes a while, on a terminal.

    convert_onnx:  40%|████      | 6/15 [00:02<00:03, decide_precision]
"""
from __future__ import annotations

from dataclasses import replace

from amp_compiler.passes.runner import Pass, Pipeline

PROGRESS_AFTER_SECONDS = 2.0   # a progress bar appears only for work that takes longer than this


class ConversionProgress:
    """A progress bar on stderr: advance(name) per step, tensor_written per saved tensor. enabled=None: shown
    only after PROGRESS_AFTER_SECONDS, and only on a terminal (tqdm's own rules); False: never; True: always."""

    def __init__(self, steps: int, *, enabled: bool | None = None, desc: str = "convert_onnx"):
        self.steps, self.enabled, self.desc, self.bar = steps, enabled, desc, None
        self.tensors = 0

    def __enter__(self) -> "ConversionProgress":
        if self.enabled is not False:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.steps, desc=self.desc, unit="step", leave=False,
                            delay=0 if self.enabled else PROGRESS_AFTER_SECONDS,
                            disable=False if self.enabled else None)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def advance(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
            self.bar.update(1)

    def saving(self) -> None:
        self.advance("save")

    def tensor_written(self, tensor, info) -> None:
        self.tensors += 1
        if self.bar is not None and self.tensors % 16 == 0:
            self.bar.set_postfix_str(f"save: {self.tensors} tensors written")


def announcing(pipeline: Pipeline, on_pass) -> Pipeline:
    """`pipeline` with on_pass(name) called as each pass starts (the same passes, names and conditions)."""
    if on_pass is None:
        return pipeline

    def announced(step: Pass):
        def run(state):
            on_pass(step.name)
            return step.run(state)
        return run
    return replace(pipeline, passes=tuple(replace(p, run=announced(p)) for p in pipeline.passes))   # declarations kept
