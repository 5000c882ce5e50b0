"""What a dynamo graph's inputs and module paths are in the user's terms, written on the graph before the passes.

Dynamo inlines modules: a weight is a placeholder, not a get_attr, and each node's nn_module_stack names its module
from the compiled frame's root ("L['self'].model.layers.0.mlp" for model.compile(), "L['args'][0]..." for
torch.compile(model)). What this relies on (torch 2.13, checked by tests/dynamo/test_dynamo_capture.py):
- the backend's example inputs are the real tensors, in placeholder order, parameters as nn.Parameter: a parameter
  or buffer of the user's model is found by identity (the exact answer when the model is known);
- else a placeholder's name spells its source: l_self_modules_fc_parameters_weight_ is self.fc.weight (dynamo's
  `modules_` / `parameters_` / `buffers_` path segments; a module attribute named like a segment is misread);
- dynamo's graph is the backend's to rewrite (a fresh GraphModule per captured graph, guarded by nothing);
- each node's meta["example_value"] is its fake value (dynamo's own propagation): copied to meta["val"], it spares
  the pipeline a fake run of its own, and the example inputs are never run (a run could change what dynamo guards on).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch import nn

_ROOT = re.compile(r"^L\[[^\]]+\](\[[^\]]+\])*\.?")   # L['self'] / L['args'][0] / L['fn'] and the dot after it
_SEGMENT = re.compile(r"_(modules|parameters|buffers)_")


def user_path(dynamo_path: str) -> str:
    """"L['self'].model.layers.0.mlp" -> "model.layers.0.mlp" (the path in the user's module tree)."""
    return _ROOT.sub("", dynamo_path)


def name_from_placeholder(name: str) -> str | None:
    """"l_self_modules_fc_parameters_weight_" -> "fc.weight"; None for a placeholder that is no module state."""
    if not _SEGMENT.search(name):
        return None
    parts = _SEGMENT.split(name.rstrip("_"))   # [root, kind, name, kind, name, ...]
    return ".".join(parts[2::2])


def parameter_names(gm: fx.GraphModule, example_inputs, model: nn.Module | None = None) -> dict[str, dict]:
    """{placeholder name: {"name": the user's parameter/buffer name, "kind": "parameter" | "buffer"}}."""
    known = {}
    if model is not None:
        known.update({id(t): (n, "buffer") for n, t in model.named_buffers(remove_duplicate=False)})
        known.update({id(t): (n, "parameter") for n, t in model.named_parameters(remove_duplicate=False)})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {}
    for node, value in zip(placeholders, example_inputs):
        if id(value) in known:
            name, kind = known[id(value)]
        elif (name := name_from_placeholder(node.name)) is not None:
            kind = "parameter" if isinstance(value, nn.Parameter) else "buffer"
        elif isinstance(value, nn.Parameter):
            name, kind = node.name, "parameter"
        else:
            continue
        names[node.name] = {"name": name, "kind": kind}
    return names


def frame_prefixes(names: dict) -> dict[str, str]:
    """{a frame root as placeholders spell it ("l_self", "l_stack0"): that module's path in the user's model}, read
    off the parameters parameter_names found: a graph of a child's own frame (a graph break inside it) or of a
    resumed frame holding a submodule (L['stack0']) names modules from that frame, not from the model."""
    prefixes: dict[str, str] = {}
    for placeholder, info in names.items():
        local = name_from_placeholder(placeholder)
        full = info["name"]
        if local and (full == local or full.endswith(f".{local}")):
            root = _SEGMENT.split(placeholder.rstrip("_"))[0]
            prefixes.setdefault(root, full[:len(full) - len(local)].rstrip("."))
    return prefixes


def _frame_root(dynamo_path: str) -> str:
    """"L['___stack0'].lin" -> "l_stack0", "L['args'][0]" -> "l_args_0": the root as placeholder names spell it."""
    match = _ROOT.match(dynamo_path)
    if match is None:
        return ""
    names = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]", match.group(0))   # dynamo's ___stack0 is l_stack0_
    return "_".join(["l", *(name.strip("_") for name in names)])


def _in_model(dynamo_path: str, prefixes: dict[str, str]) -> str:
    path = user_path(dynamo_path)
    prefix = prefixes.get(_frame_root(dynamo_path), "")
    return ".".join(p for p in (prefix, path) if p)


def prepare_graph(gm: fx.GraphModule, prefixes: dict[str, str] | None = None) -> None:
    """Module paths in the user's terms (`prefixes`: frame_prefixes), dynamo's fake values as meta["val"] (what the
    pipeline reads), and no call of torch's usage logger (dynamo records `torch._C._log_api_usage_once`: a no-op
    explain would call unknown)."""
    prefixes = prefixes or {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._log_api_usage_once and not node.users:
            gm.graph.erase_node(node)
            continue
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {key: (_in_model(path, prefixes), kind) for key, (path, kind) in stack.items()}
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]   # a node without one: infer_dtypes' rules decide its dtype


