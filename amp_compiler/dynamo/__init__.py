"""TorchDynamo as a capture front end (opt-in for now): amp_compiler.compile(model, level).

What it is: a torch.compile backend (backend.amp_backend) that runs the project's fx pipeline on every graph dynamo
captures (graph breaks, guards, recompiles and dynamic shapes are dynamo's), then runs the rewritten graph as fx
code (backend="eager") or hands it to inductor (backend="inductor"). Each graph keeps its decisions in
gm.meta["amp"] (explain(graph) works); graphs(model) lists them. Module paths come from dynamo's nn_module_stack and
weight inputs are named by the user's parameters (graph_inputs.py says what that relies on).

What it is not yet: convert(inplace=True) and the integrations still use in_place/ (they are to move onto it);
there is no weight-cast cache, so every weight is cast on every call (decode is slower than autocast's cached
casts); explain(model) does not merge the graphs into one report.

Measured (torch 2.13 CPU, tiny HF Llama hidden 64 x 2 layers, bf16, tests/test_dynamo_capture.py):
- forward (2 x 12 tokens): 1 graph of 223 nodes, no graph break, converted in 0.03 s (the first call, dynamo's
  tracing included, 1.2 s); every matmul low; error against fp32 3.4e-3, autocast's 2.7e-3 (1.26x); backward works;
- greedy generate() with a DynamicCache, 8 new tokens: 3 graphs (prefill, first decode, dynamic-shape decode),
  0.025 s of conversion each; 51 of 51 matmul/attention nodes low (sdpa 6 of 6); tokens equal autocast's;
- tests/test_dynamo_capture.py: 8 tests, 21-32 s on 2 busy cores (3-13 s of it inductor's C++ build for one MLP).
"""
from amp_compiler.dynamo.backend import amp_backend, convert_captured_graph, graphs
from amp_compiler.dynamo.compile import compile  # noqa: A004

__all__ = ["amp_backend", "compile", "convert_captured_graph", "graphs"]
