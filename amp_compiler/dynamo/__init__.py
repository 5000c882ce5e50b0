"""TorchDynamo as the in-place capture: convert(model, level, inplace=True) and amp_compiler.compile.

    backend.py       amp_backend: the fx pipeline on every graph dynamo captures, fallbacks to autocast
    compile.py       CompiledForward, the model's instance forward: settings around its calls, restore
    graph_inputs.py  dynamo's placeholders and module paths in the user's terms
    bodies.py        torch.utils.checkpoint's bodies converted as graphs of their own, still recomputed
    weight_cache.py  each parameter's low copy made once while it is unchanged (inference, frozen bases)
    cache_state.py   a KV cache's tensors are state: kept in the low dtype, as under autocast
    calibration.py   calibration_data: each graph calibrated on the tensors it received while the samples ran
    fp8_histories.py fp8 delayed scaling: one amax history per matmul, shared by every graph, in the state_dict
    effects.py       a conversion-time call's effects (buffers, histories) undone
    in_place.py      convert(inplace=True)'s checks and example-inputs call; restore(model)
    report.py        explain(model): every graph, graph breaks, recompiles and fallbacks in one report; compare,
                     verify: each graph a call runs, on the tensors it received

Graph breaks, guards, recompiles and dynamic shapes are dynamo's. Where dynamo or the passes cannot give a graph,
the model still runs, under torch.autocast with the level's dtype, and says so (warnings and explain). A model
FSDP2 shards per block is compiled per block (compile.py). dynamic_shapes does not apply: dynamo marks a dim
dynamic when it changes. Figures: README, "On TorchDynamo's capture".
"""
from amp_compiler.dynamo.backend import amp_backend, convert_captured_graph, graphs
from amp_compiler.dynamo.compile import compile  # noqa: A004

__all__ = ["amp_backend", "compile", "convert_captured_graph", "graphs"]
