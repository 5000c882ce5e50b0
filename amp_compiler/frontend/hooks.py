"""The user's module hooks keep firing on the converted module's calls, with the module's own inputs and outputs.

    a leaf with a hook (Linear, Conv...)   stays a call to the module, never lowered to F.linear; a low one runs
                                           with its parameters cast for the call (amp_module_call)
    a module fx would trace into           one opaque call: runs as written under torch.autocast
    the model itself                       its hooks move onto the converted module
    torch.export front end                 hooks run at capture and are inlined: HookWarning naming them
    global hooks (register_module_forward_hook ...)  fire for the modules the graph still calls: HookWarning
                                           naming them (the others' operations are in the graph)
Forward, forward pre-, backward and backward pre-hooks alike. No user hook fires during convert() itself
(tracing, fake-value propagation, calibration runs).
"""
from __future__ import annotations

import contextlib
import warnings

import torch.fx as fx
import torch.nn.modules.module as module_globals
from torch import nn

from amp_compiler.passes.fx.runtime import amp_frozen_module_call, amp_module_call

HOOK_DICTS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
              "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}
_ROOT_HOOK_STATE = (*HOOK_DICTS, "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                    "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook")
_GLOBAL_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


class HookWarning(UserWarning):
    """A user hook that the converted module cannot fire as the model would."""


def hook_kinds(module: nn.Module) -> list[str]:
    return [kind for name, kind in HOOK_DICTS.items() if getattr(module, name, None)]


def hooked_modules(root: nn.Module) -> dict[str, list[str]]:
    """{module path: kinds of hook registered on it} ("" is the model itself)."""
    return {name: kinds for name, module in root.named_modules() if (kinds := hook_kinds(module))}


def global_hook_kinds() -> list[str]:
    return [name.removeprefix("_global_").removesuffix("s").replace("_", " ")
            for name in _GLOBAL_DICTS if getattr(module_globals, name)]


@contextlib.contextmanager
def user_hooks_silenced(root: nn.Module | None = None):
    """No global hook, nor one of root's modules' hooks, fires inside. The dicts are emptied in place and
    refilled after, so the user's RemovableHandles still reach them, and a hook registered meanwhile (a
    profiler's global hook, another thread) is kept, after the saved ones."""
    dicts = [getattr(module_globals, name) for name in _GLOBAL_DICTS]
    for module in (root.modules() if root is not None else ()):
        dicts += [module.__dict__[name] for name in HOOK_DICTS if name in module.__dict__]
    saved = [dict(hooks) for hooks in dicts]
    for hooks in dicts:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, before in zip(dicts, saved):
            added = dict(hooks)
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


def move_root_hooks(root: nn.Module, gm: fx.GraphModule) -> None:
    """The model's own hooks fire on the converted module's calls (fx traces forward(), not __call__)."""
    for name in _ROOT_HOOK_STATE:
        if name in root.__dict__:
            value = root.__dict__[name]
            gm.__dict__[name] = value.copy() if hasattr(value, "copy") else value


def hook_fates(gm: fx.GraphModule, hooked: dict[str, list[str]], frontend: str) -> dict[str, dict]:
    """{path: {"hooks": kinds, "fires": bool, "how": words}} for explain(); warns for hooks that do not fire
    as in the model."""
    called, cast = set(), set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            called.add(node.target)
        elif node.op == "get_attr" and isinstance(_resolve(gm, node.target), nn.Module):
            called.add(node.target)
            if any(user.target in (amp_module_call, amp_frozen_module_call) for user in node.users):
                cast.add(node.target)
    fates = {}
    for path, kinds in hooked.items():
        if frontend != "fx.symbolic_trace":
            fates[path] = {"hooks": kinds, "fires": False,
                           "how": "torch.export ran it once at capture: its tensor operations are in the graph, "
                                  "anything else it does (recording, printing) does not happen on calls"}
        elif path == "":
            fates[path] = {"hooks": kinds, "fires": True, "how": "moved onto the converted module"}
        elif path in called:
            how = "the graph calls the module" + (" (its parameters cast for the call)" if path in cast else "")
            fates[path] = {"hooks": kinds, "fires": True, "how": how}
        elif (outer := next((p for p in called if path.startswith(p + ".")), None)) is not None:
            fates[path] = {"hooks": kinds, "fires": True, "how": f"inside {outer}, which the graph calls"}
        else:
            fates[path] = {"hooks": kinds, "fires": False, "how": "the graph does not call the module"}
    for path, fate in fates.items():
        if not fate["fires"]:
            warnings.warn(f"{', '.join(fate['hooks'])} on {path or 'the model'}: {fate['how']}", HookWarning,
                          stacklevel=3)
    if global_hook_kinds():
        skipped = sorted(name for name, _ in gm.named_modules() if name and not name.startswith("amp_")
                         and not any(name == p or name.startswith(p + ".") for p in called))
        shown = ", ".join(skipped[:8]) + (f" and {len(skipped) - 8} more" if len(skipped) > 8 else "")
        warnings.warn(f"global module hooks ({', '.join(global_hook_kinds())}) fire on the converted module's calls "
                      f"for the modules its graph calls ({', '.join(sorted(called)) or 'none'}), not for "
                      f"{shown or 'any other'}: their operations are nodes of the graph", HookWarning, stacklevel=3)
    return fates


def _resolve(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def hook_lines(fates: dict[str, dict]) -> list[str]:
    """explain()'s summary lines: each hooked module and what happens to its hooks."""
    return [f"hooks: {path or '(the model)'} ({', '.join(fate['hooks'])}): "
            f"{'fire' if fate['fires'] else 'DO NOT FIRE on calls'}: {fate['how']}" for path, fate in fates.items()]
