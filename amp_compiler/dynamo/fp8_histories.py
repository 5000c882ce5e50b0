"""Delayed fp8 scaling in place: one set of amax histories per matmul of the user's model, in its state_dict.

convert(model, "fp8", fp8_scaling="delayed", inplace=True): dynamo makes graphs lazily, each with its own
Fp8History modules (gm.fp8_history.<node>). Left there, the histories would be in no checkpoint (the graphs
are outside the model's module tree), a resumed run would restart them empty, and an eval graph (made apart from
the training graph) would read an empty history of its own. So the compiled forward keeps the history tensors,
keyed by the matmul's module path, and every graph dynamo makes (train, eval, prefill, decode) holds those very
tensors as its Fp8History buffers:

    state_dict()       adds   <module path>._amp_fp8_history.{x,w,grad}     (a matmul of another parameter of
                                                                             the module: _amp_fp8_history_<name>;
                                                                             one weight read twice: ..._0of2,
                                                                             ..._1of2; _histories_by_key)
    load_state_dict()  takes  them back (before any capture too: the graphs captured later start from them);
                       a history the model holds that the loaded dict lacks is a missing key (strict raises)

A sharded checkpoint keeps them out of state_dict() meanwhile (Fp8HistoryStore.in_state_dict): DCP's get_state_dict
refuses keys that are no attributes of the model, and each rank's histories are its own (train/sharded_checkpoint.py
saves them per rank). Nothing else changes in the state_dict; a model converted at another level or recipe has no such keys (load a
delayed checkpoint there with strict=False). Each graph's Fp8History keeps its own training flag: only
training-mode graphs record, eval graphs read what training recorded.
"""
from __future__ import annotations

import collections

import torch
from torch import nn

from amp_compiler.passes.fx.fp8_runtime import HISTORIES, Fp8History
from amp_compiler.passes.node_facts import facts

STATE_NAME = "_amp_fp8_history"   # <module path>.<STATE_NAME>.<x|w|grad> in the model's state_dict


class Fp8HistoryStore:
    """The conversion's amax histories: key (see module docstring) -> {"x", "w", "grad": the shared tensor}."""

    def __init__(self, model: nn.Module, length: int):
        self.length = length   # fp8_history: how many calls each history holds
        self.not_mine: tuple = ()   # paths of submodules compiled with their own store (an encoder-decoder's encoder)
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.in_state_dict = True   # False: state_dict() leaves the histories out (a checkpoint saving them apart)
        self.handles = [model.register_state_dict_post_hook(_Hook(self, "add_to_state_dict")),
                        model.register_load_state_dict_pre_hook(_Hook(self, "take_from_state_dict"))]

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()

    # -- graphs ---------------------------------------------------------------------------------------------
    def bind(self, gm: torch.fx.GraphModule) -> None:
        """Make each Fp8History of a graph dynamo just made hold the store's tensors for its matmul (the graph's
        own zeros, or its calibrated start, become the store's when the matmul has none yet)."""
        for key, history in _histories_by_key(gm).items():
            shared = self.tensors.get(key)
            if shared is None:
                self.tensors[key] = {name: getattr(history, name) for name in HISTORIES}
                continue
            for name in HISTORIES:
                own = getattr(history, name)
                tensor = shared[name]
                if tensor.shape != own.shape:
                    raise ValueError(f"{key}.{name}: the amax history holds {tensor.numel()} calls, this "
                                     f"conversion's fp8_history is {own.numel()}")
                if tensor.device != own.device:   # loaded onto the CPU: the graph's device from now on
                    tensor.data = tensor.data.to(own.device)
                history._buffers[name] = tensor

    # -- state_dict hooks ------------------------------------------------------------------------------------
    def add_to_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        if not self.in_state_dict:
            return
        for key, tensors in self.tensors.items():
            for name, tensor in tensors.items():
                state_dict[f"{prefix}{key}.{name}"] = tensor.detach()

    def take_from_state_dict(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                             unexpected_keys, error_msgs) -> None:
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        theirs = tuple(f"{prefix}{path}." for path in self.not_mine)   # a submodule's own store takes those
        for full_key in [k for k in state_dict if k.startswith(prefix) and _is_history_key(k[len(prefix):])
                         and not k.startswith(theirs)]:
            key, name = full_key[len(prefix):].rsplit(".", 1)
            loaded.setdefault(key, {})[name] = state_dict.pop(full_key)
        for key in self.tensors.keys() - loaded.keys():
            missing_keys.extend(f"{prefix}{key}.{name}" for name in HISTORIES)
        for key, values in loaded.items():
            if set(values) != set(HISTORIES):
                error_msgs.append(f"fp8 amax history {prefix}{key}: has {sorted(values)}, needs {list(HISTORIES)}")
                continue
            shared = self.tensors.get(key)
            wrong_length = [name for name, value in values.items() if value.numel() != self.length]
            if shared is None and wrong_length:   # the graph captured later could not take it (bind refuses)
                error_msgs.extend(_length_error(f"{prefix}{key}.{name}", values[name], self.length)
                                  for name in wrong_length)
                continue
            if shared is None:   # not captured yet: the graph captured later takes these
                self.tensors[key] = {name: value.detach().clone().float() for name, value in values.items()}
                continue
            for name, value in values.items():
                if value.shape != shared[name].shape:
                    error_msgs.append(_length_error(f"{prefix}{key}.{name}", value, shared[name].numel()))
                    continue
                with torch.no_grad():
                    shared[name].copy_(value)


def pop_history_keys(state_dict: dict) -> dict:
    """The amax history entries of a state_dict, taken out of it (a checkpoint that stores them apart)."""
    return {key: state_dict.pop(key) for key in [k for k in state_dict if _is_history_key(k)]}


def _length_error(key: str, loaded: torch.Tensor, length: int) -> str:
    return f"fp8 amax history {key}: {loaded.numel()} calls in the checkpoint, {length} in this conversion " \
           "(fp8_history)"


class _Hook:
    """A store's method as a hook torch can tag (register_*_hook sets an attribute on it) and pickle."""

    def __init__(self, store: Fp8HistoryStore, method: str):
        self.store, self.method = store, method

    def __call__(self, *args):
        return getattr(self.store, self.method)(*args)


def _is_history_key(key: str) -> bool:
    parts = key.split(".")
    return len(parts) >= 2 and parts[-1] in HISTORIES and parts[-2].startswith(STATE_NAME)


def _histories_by_key(gm: torch.fx.GraphModule) -> dict[str, Fp8History]:
    """{"<user's module path>.<STATE_NAME>[_<weight>][_<i>of<n>]": the graph's Fp8History} for its delayed-scaled
    matmuls. A matmul is named by the parameter it reads as w, not by its place in the graph: a model's graphs
    (train, eval) may run different matmuls of one module (an `if self.training` branch), and each must get the
    history of its own weight. The module's own `weight` (or a tied one) keeps the plain key; another of its
    parameters adds its name (F.linear(x, self.w_in): _amp_fp8_history_w_in). Where one name is read by n > 1
    matmuls of a graph (a Linear called twice; a w that is no parameter), the i-th in graph order is _<i>of<n>:
    graphs that call it as often share them, and one that calls it another number of times (an eval graph
    without the training-only call) cannot be paired call by call, so it shares none of them."""
    bases: list[tuple[str, Fp8History]] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.target.startswith("fp8_history."):
            continue
        module = next((facts(user).get("module") for user in node.users if facts(user).get("module") is not None),
                      None)
        inside = module   # the user's module path (dynamo's nn_module_stack, graph_inputs.py)
        base = f"{inside}.{STATE_NAME}" if inside else STATE_NAME
        if inside is None:   # no module recorded: the node's name keeps it apart
            base = f"{base}_{node.target.rsplit('.', 1)[1]}"
        else:
            own = _own_name(_weight_parameter(node, gm), inside)
            if own is not None and own != "weight":
                base = f"{base}_{own.replace('.', '_')}"
        bases.append((base, gm.get_submodule(node.target)))
    counts = collections.Counter(base for base, _ in bases)
    seen: collections.Counter = collections.Counter()
    found: dict[str, Fp8History] = {}
    for base, history in bases:
        key = base if counts[base] == 1 else f"{base}_{seen[base]}of{counts[base]}"
        seen[base] += 1
        found[key] = history
    return found


def _own_name(parameter: str | None, module: str) -> str | None:
    """`parameter`'s name inside `module` (both the user's paths), or None when it is not the module's (a weight
    tied to another module's, as an lm_head to its embedding: named by that module, the matmul keeps the plain
    key)."""
    if parameter is None or not module:
        return parameter
    return parameter.removeprefix(f"{module}.") if parameter.startswith(f"{module}.") else None


def _weight_parameter(history_node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """The user's name of the parameter the matmul of `history_node` scales as its w operand (through the casts
    and views before its amax: a placeholder dynamo names), or None when w is computed (an activation)."""
    scale = next((user for user in history_node.users if len(user.args) > 2 and user.args[2] == "w"), None)
    amax = scale.args[0] if scale is not None else None
    node = amax.args[0] if isinstance(amax, torch.fx.Node) and amax.args else None
    while isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") \
            and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    weight = gm.meta.get("amp", {}).get("graph_inputs", {}).get(node.name)
    return weight["name"] if weight is not None and weight["kind"] == "parameter" else None
