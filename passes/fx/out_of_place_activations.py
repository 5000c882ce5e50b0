"""Run in-place activation modules out of place, for an inference export, where nothing else sees the write.

    out = self.bn1(conv(x)); out = self.relu(out)      nn.ReLU(inplace=True)   ->   nn.ReLU(inplace=False)
    (the written tensor is fresh and read by the ReLU alone, in every call of that module)

torch.onnx writes a functional graph either way, so for the exported model the flag changes nothing but the
painting: convert() keeps an in-place op in the dtype of the tensor it writes and leaves it out of the
painted view (a cast in front of it would write into a copy), which cuts the low-precision chain
conv -> relu_ -> conv. ResNet's residual Add then sees no low-precision reader and stays fp32, with a Cast
pair per block (ResNet-18: 22 Casts after batch-norm folding; 2 with out-of-place ReLUs).

The write is invisible, so the flag can go, when the tensor an in-place call writes was made by a computing
op (a leaf module such as a conv or a batch norm, or an allow/infer/deny op: not a view, not an identity, not
another in-place op, not a graph input or parameter) and that call is its only reader; this must hold for
every call of the module (torchvision's BasicBlock calls one ReLU twice). Only the torch.fx front end's
graphs are analysed (nodes carry canonicalize's facts and their module in nn_module_stack).

  find_inplace_activations(gm)          analysis of a canonicalized fx graph: module paths whose flag can go
  make_out_of_place(root, paths)        rewrite of a module tree the caller owns: fresh copies, inplace=False
  make_out_of_place_in_graph(gm, paths) the same on a torch.fx capture (its tree is its own), and its calls
                                        made as a capture of the edited model makes them: inplace=False
"""
from __future__ import annotations

import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.decide_precision import module_path
from amp_compiler.passes.fx.module_tree_edits import fresh_copy, get_module, set_module
from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import ACTIVATION_MODULES
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.runner import PassResult

_ALIASING_MODULES = (nn.Identity, nn.modules.dropout._DropoutNd)   # return their input (eval dropout)
_COMPUTING = ("allow", "infer", "deny")


def find_inplace_activations(gm: fx.GraphModule) -> list[str]:
    """Module paths of in-place activation modules whose every call writes a tensor nothing else reads."""
    calls: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and facts(node).get("inplace"):
            path = module_path(node)
            module = get_module(gm, path) if path else None
            if type(module) in ACTIVATION_MODULES and getattr(module, "inplace", False):
                calls.setdefault(path, []).append(node)
    return [path for path, nodes in calls.items() if all(_write_is_invisible(node) for node in nodes)]


def make_out_of_place(root: nn.Module, paths: list[str]) -> PassResult:
    """Replace each module at `paths` in `root` (a tree the caller owns) by a copy with inplace=False."""
    for path in paths:
        copy = fresh_copy(get_module(root, path))
        copy.inplace = False
        set_module(root, path, copy)
    return PassResult(modified=bool(paths), counts={"activations_made_out_of_place": len(paths)})


def make_out_of_place_in_graph(gm: fx.GraphModule, paths: list[str]) -> PassResult:
    """make_out_of_place on `gm`'s own module tree (a capture's), and the activation calls of those modules in
    its graph given inplace=False (torch.nn's activations pass `inplace` to torch.nn.functional by keyword)."""
    result = make_out_of_place(gm, paths)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("inplace") is True and module_path(node) in paths:
            node.kwargs = {**node.kwargs, "inplace": False}
    gm.recompile()
    return result


def _write_is_invisible(node: fx.Node) -> bool:
    written = node.args[0] if node.args else None
    if not isinstance(written, fx.Node) or len(written.users) != 1:
        return False
    if written.op == "call_module":
        return not isinstance(get_module(node.graph.owning_module, written.target), _ALIASING_MODULES)
    if written.op not in ("call_function", "call_method") or facts(written).get("inplace"):
        return False
    rule = POLICY.get(facts(written).get("op", ""))
    return rule is not None and rule.op_class in _COMPUTING
