"""Front end: turn a user's nn.Module into an fx GraphModule the passes can rewrite.

    capture(model, example_inputs)  ->  CapturedGraph     (capture.py: the one place a model is traced)
    convert.compile_graph(captured, config)  ->  GraphModule (a copy of the captured graph, its passes run)
The GraphModule shares the model's parameters and buffers through a shallow copy of the module tree, so
train()/eval() on it never flips the user's modules and state_dict() keys are the original's.
"""
from __future__ import annotations

from amp_compiler.frontend.capture import CapturedGraph, capture, graph_module_to_compile
from amp_compiler.frontend.errors import TracingError
from amp_compiler.frontend.module_tree import share_module_tree

__all__ = ["CapturedGraph", "TracingError", "capture", "graph_module_to_compile", "share_module_tree", "trace",
           "TracedModel"]

trace, TracedModel = capture, CapturedGraph   # the names tests and notebooks used before the capture seam
