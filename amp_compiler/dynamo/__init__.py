"""TorchDynamo as a capture front end: convert(model, level, inplace=True, capture="dynamo") and amp_compiler.compile.

    backend.py       amp_backend: the fx pipeline on every graph dynamo captures, fallbacks to autocast
    compile.py       CompiledForward, the model's instance forward: settings around its calls, restore
    graph_inputs.py  dynamo's placeholders and module paths in the user's terms
    bodies.py        torch.utils.checkpoint's bodies converted as graphs of their own, still recomputed
    weight_cache.py  each parameter's low copy made once while it is unchanged (inference, frozen bases)
    cache_state.py   a KV cache's tensors are state: kept in the low dtype, as under autocast
    calibration.py   calibration_data: each graph calibrated on the tensors it received while the samples ran
    report.py        explain(model): every graph, graph breaks, recompiles and fallbacks in one report; compare,
                     verify: each graph a call runs, on the tensors it received

Graph breaks, guards, recompiles and dynamic shapes are dynamo's. Where dynamo or the passes cannot give a graph,
the model still runs, under torch.autocast with the level's dtype, and says so (warnings and explain). Not yet on
this capture (capture="parts" takes them): dynamic_shapes, fp8 delayed scaling. A model
FSDP2 shards per block is compiled per block (compile.py). Figures: README, "On TorchDynamo's
capture".
"""
from amp_compiler.dynamo.backend import amp_backend, convert_captured_graph, graphs
from amp_compiler.dynamo.compile import compile  # noqa: A004

__all__ = ["amp_backend", "compile", "convert_captured_graph", "graphs"]
