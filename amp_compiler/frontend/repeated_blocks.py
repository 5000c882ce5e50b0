"""Capture once per repeated block (torch.export path): export a few of a model's identical blocks, copy the rest.

An LLM's 32 decoder layers (a ViT's blocks) are the same code on other parameters; torch.export costs the same
for each. So, when a ModuleList / Sequential holds at least MIN_BLOCKS structurally identical blocks:

    repeated_blocks(root)        the container and its blocks, or None (module tree types, parameter and buffer
                                 shapes/dtypes/flags, attribute values must match; an int attribute equal to the
                                 block's own index, Hugging Face's layer_idx, may differ: the check below shows
                                 whether the graph depends on it)
    with repeat.few_blocks():    the capture's own container holds blocks 0, 1, 2 and the last one only
        export                   one trace of 4 blocks instead of N
    repeat.splice(graph)         block 2's nodes copied for blocks 3..N-2, the last block re-wired after them.
                                 Refused (NotSpliceable: the caller exports the whole model) unless blocks 1, 2
                                 and the last are node for node the same (op, target, constants, submodule,
                                 reading the block before at the same place or the same outside node), each
                                 block's nodes are contiguous, and nothing outside reads a block but the last

Blocks 1 and 2 and the last one differing in nothing shows the graph reads no per-block index (a layer_idx % 2
would differ between 1 and 2, a "last layer" test between 2 and the last). Node names are the ones a full
export gives (each op's counter advances by the same step per block), except nodes torch.export numbers after
tracing (sym_size_int_*), whose numbers depend on how many blocks it traced. The nodes copied share their
template's fake values (same shapes). A forward that indexes its blocks by count (`self.layers[i]` for i in
range(config.num_hidden_layers)) fails the short export: the whole model is exported, as before.

A forward that branches on a middle block's position in the loop (`if i == 5`, `config.types[i]` read by the
model's loop rather than stored on the block) would not be seen by blocks 1, 2 and the last agreeing, and block 5
would get block 2's graph: so the container's owner must read it blindly (`for block in self.layers`, a slice of
it, `self.layers(x)`, `len(self.layers)`; its forward's source is read), else the whole model is exported. A
position counted by hand in the loop's body (`n += 1; if n == 5`) is still not seen.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import re
import textwrap
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from amp_compiler.frontend.hooks import HOOK_DICTS

MIN_BLOCKS = 8   # 4 are traced: fewer save little, and a refused short export costs half a full one more
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_INERT = (type(None), bool, int, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_NAME = re.compile(r"^(.*)_(\d+)$")


class NotSpliceable(Exception):
    """The short export does not show N identical blocks: export the whole model."""


@dataclass
class Repeat:
    path: str                   # the container's path in the capture's root ("model.layers")
    container: nn.Module
    keys: list[str]             # its children's names, in order
    refused: str | None = None  # why the short export did not hold (the whole model was exported)

    @property
    def count(self) -> int:
        return len(self.keys)

    @property
    def traced(self) -> list[int]:   # real block indices traced, at positions 0..3 of the short container
        return [0, 1, 2, self.count - 1]

    @contextlib.contextmanager
    def few_blocks(self):
        full = self.container._modules
        self.container._modules = {str(i): full[self.keys[b]] for i, b in enumerate(self.traced)}
        try:
            yield
        finally:
            self.container._modules = full

    def block_module(self, index: int) -> nn.Module:
        return self.container._modules[self.keys[index]]

    def splice(self, graph: fx.Graph) -> fx.Graph:
        return _Splice(self, graph).graph()

    def extend_reads(self, reads: list) -> list:
        """Training-flag reads (module, flag) of the short export, block 2's repeated for blocks 3..N-2 after it."""
        relative = {id(m): name for name, m in self.block_module(2).named_modules()}
        of_template = [i for i, (module, _) in enumerate(reads) if id(module) in relative]
        if not of_template:
            return reads
        extra = [(self.block_module(k).get_submodule(relative[id(reads[i][0])]), reads[i][1])
                 for k in range(3, self.count - 1) for i in of_template]
        return reads[:of_template[-1] + 1] + extra + reads[of_template[-1] + 1:]


def repeated_blocks(root: nn.Module) -> Repeat | None:
    """The container with the most identical blocks (at least MIN_BLOCKS), or None."""
    best = None
    for path, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module._modules) < MIN_BLOCKS:
            continue
        keys = list(module._modules)
        blocks = [module._modules[k] for k in keys]
        if any(b is None for b in blocks) or len({id(b) for b in blocks}) < len(blocks):   # one layer called N times
            continue
        first = _facts(blocks[0])
        if first is not None and all(_same_but_index(first, _facts(b), i) for i, b in enumerate(blocks[1:], 1)) \
                and (best is None or len(keys) > best.count) and _owner_loops_blindly(root, path):
            best = Repeat(path, module, keys)
    return best


def _owner_loops_blindly(root: nn.Module, path: str) -> bool:
    """The forward of the container's owner reads it only as `for block in self.x` (or a slice of it),
    `self.x(...)` or `len(self.x)`: no position (`enumerate`, `zip`, `self.x[i]`) that a middle block's graph
    could depend on (`if i == 5`), which blocks 1, 2 and the last agreeing would not show. Unknown: False."""
    owner_path, _, attribute = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    blind = set()   # ids of the `self.x` nodes read in an allowed way
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            iterated = node.iter.value if isinstance(node.iter, ast.Subscript) and \
                isinstance(node.iter.slice, ast.Slice) else node.iter
            blind.add(id(iterated))
        elif isinstance(node, ast.Call) and (isinstance(node.func, ast.Attribute) or
                                             (isinstance(node.func, ast.Name) and node.func.id == "len")):
            blind.add(id(node.func) if isinstance(node.func, ast.Attribute) else id(node.args[0] if node.args else node))
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == attribute
             and isinstance(node.value, ast.Name) and node.value.id == "self"]
    return bool(reads) and all(id(read) in blind for read in reads)


def _facts(block: nn.Module) -> list | None:
    """What a capture of the block depends on besides tensor values, module by module; None with hooks (they
    could differ between blocks). Attributes: constants by type and value, other objects (a config all blocks
    share) by identity."""
    facts = []
    for path, module in block.named_modules(remove_duplicate=False):
        if any(module.__dict__.get(name) for name in HOOK_DICTS):
            return None
        attributes = tuple((name, _constant(value)) for name, value in module.__dict__.items()
                           if name not in _MODULE_INTERNALS)
        facts.append((path, (type(module), module.training, tuple(module._modules),
                             tuple((name, _tensor_facts(p)) for name, p in module._parameters.items()),
                             tuple((name, _tensor_facts(b)) for name, b in module._buffers.items()), attributes)))
    return facts


def _constant(value):
    kind = type(value)
    if kind is float:
        return kind, repr(value)   # -0.0 and nan as themselves
    if kind in _INERT:
        return kind, value
    if kind in (tuple, list):
        return kind, tuple(_constant(item) for item in value)
    return "object", id(value)


def _tensor_facts(tensor):
    if tensor is None:
        return None
    return type(tensor), tuple(tensor.shape), tensor.dtype, tensor.requires_grad, tensor.device


def _same_but_index(first: list, other: list | None, index: int) -> bool:
    """Block 0's facts and block `index`'s equal, but for int attributes that hold each block's own index
    (layer_idx): the splice's check shows whether the graph depends on them."""
    if other is None or len(first) != len(other):
        return False
    for (path, (*rest, attributes)), (path2, (*rest2, attributes2)) in zip(first, other):
        if path != path2 or rest != rest2 or len(attributes) != len(attributes2):
            return False
        for (name, value), (name2, value2) in zip(attributes, attributes2):
            if name != name2 or (value != value2 and (value, value2) != ((int, 0), (int, index))):
                return False
    return True


class _Splice:
    """The full graph from a short export's: one pass over the nodes, block 2's copied in after block 2."""

    def __init__(self, repeat: Repeat, graph: fx.Graph):
        self.repeat, self.source = repeat, graph
        self.prefix = [f"{repeat.path}.{i}" for i in range(4)] if repeat.path else [str(i) for i in range(4)]
        self.block_of = {node: self._block(node) for node in graph.nodes}
        self.members = {b: [n for n in graph.nodes if self.block_of[n] == b] for b in range(4)}
        self.position = {node: i for b in range(4) for i, node in enumerate(self.members[b])}
        self._check_layout()
        for later in (2, 3):
            self._check_same(later - 1, later)
        self.steps = self._counter_steps()

    # which block a node belongs to: its parameter's path, else the innermost module it ran in
    def _block(self, node: fx.Node) -> int | None:
        if node.op == "get_attr":
            return self._block_of_path(node.target)
        if node.op in ("placeholder", "output"):
            return None
        stack = node.meta.get("nn_module_stack") or {}
        for fqn, _ in reversed(list(stack.values())):
            block = self._block_of_path(fqn)
            if block is not None:
                return block
        return None

    def _block_of_path(self, path) -> int | None:
        if not isinstance(path, str):
            return None
        for b, prefix in enumerate(self.prefix):
            if path == prefix or path.startswith(prefix + "."):
                return b
        return None

    def _check_layout(self) -> None:
        """Each block's get_attrs and ops contiguous, blocks in order; outside nodes read only the last block."""
        for kind in (lambda n: n.op == "get_attr", lambda n: n.op != "get_attr"):
            order = [self.block_of[n] for n in self.source.nodes if kind(n) and self.block_of[n] is not None]
            runs = [b for i, b in enumerate(order) if i == 0 or order[i - 1] != b]
            if runs and runs != sorted(set(runs)):
                raise NotSpliceable(f"blocks' nodes interleave ({runs[:8]})")
        if any(not self.members[b] for b in range(4)):
            raise NotSpliceable("a traced block has no nodes")
        ops = [n for n in self.source.nodes if n.op not in ("get_attr", "placeholder", "output")]
        inside = [i for i, n in enumerate(ops) if self.block_of[n] is not None]
        between = [n.name for n in ops[inside[0]:inside[-1]] if self.block_of[n] is None]
        if between:
            raise NotSpliceable(f"{between[0]} runs between blocks")
        self.epilogue = set(ops[inside[-1] + 1:])
        for node in self.source.nodes:
            for arg in node.all_input_nodes:
                read, reader = self.block_of[arg], self.block_of[node]
                if read is not None and read != reader and read != 3 and reader != read + 1:
                    raise NotSpliceable(f"{node.name} reads {arg.name} of block {read}")

    def _check_same(self, a: int, b: int) -> None:
        left, right = self.members[a], self.members[b]
        if len(left) != len(right):
            raise NotSpliceable(f"blocks {self.repeat.traced[a]} and {self.repeat.traced[b]} differ in size")
        for x, y in zip(left, right):
            if (x.op, self._local(x.target, a)) != (y.op, self._local(y.target, b)) or \
                    self._stack(x, a) != self._stack(y, b) or \
                    self._shape(x.args, a) != self._shape(y.args, b) or \
                    self._shape(x.kwargs, a) != self._shape(y.kwargs, b):
                raise NotSpliceable(f"{x.name} and {y.name} differ")

    def _local(self, target, block: int):
        if isinstance(target, str) and self._block_of_path(target) == block:
            return target[len(self.prefix[block]):]
        return target

    def _stack(self, node: fx.Node, block: int):
        return [self._local(fqn, block) for fqn, _ in (node.meta.get("nn_module_stack") or {}).values()] + \
            [str(kind) for _, kind in (node.meta.get("nn_module_stack") or {}).values()]

    def _shape(self, value, block: int):
        """An argument with its nodes as (where, position) and its constants by type and value."""
        if isinstance(value, fx.Node):
            read = self.block_of[value]
            if read == block:
                return "own", self.position[value]
            if read is not None and read == block - 1:
                return "previous", self.position[value]
            return "outside", value
        if isinstance(value, (tuple, list)):
            return type(value), tuple(self._shape(v, block) for v in value)
        if isinstance(value, dict):
            return dict, tuple((k, self._shape(v, block)) for k, v in value.items())
        if isinstance(value, slice):
            return slice, self._shape((value.start, value.stop, value.step), block)
        return type(value), value if _plain(value) else id(value)

    def _counter_steps(self) -> dict[str, int]:
        """Per op name, how far its counter moves per block: the span of its numbers in the block traced 4th (block 3
        of a full export too; torch.export skips numbers in some blocks it traces first, never after)."""
        numbers: dict[str, list[int]] = {}
        for node in self.members[3]:
            if node.op != "get_attr":
                base, number = _split(node.name)
                if number is None:
                    raise NotSpliceable(f"node {node.name} has no number to count on")
                numbers.setdefault(base, []).append(number)
        return {base: max(found) - min(found) + 1 for base, found in numbers.items()}

    def _name(self, node: fx.Node, position: int | None, block: int) -> str:
        """A node's name in a full export, as block `block`'s (position: where it is in the short export; None:
        after the blocks): the name of the block traced 4th (block 3), its counter moved on by blocks 3..block."""
        if node.op == "get_attr" and position is not None:
            return _renamed_path(node.name, self.prefix[position], self._real(block))
        counterpart = self.members[3][self.position[node]] if position == 2 else node
        base, number = _split(counterpart.name)
        if number is None or base not in self.steps:
            return counterpart.name
        return f"{base}_{number + (block - 3) * self.steps[base]}"

    def _real(self, block: int) -> str:
        return f"{self.repeat.path}.{block}" if self.repeat.path else str(block)

    def graph(self) -> fx.Graph:
        """Nodes in the short export's order; after block 2's get_attrs (ops), blocks 3..N-2's copies of them."""
        count = self.repeat.count
        out = fx.Graph()
        out._codegen = copy.deepcopy(self.source._codegen)
        env: dict[fx.Node, fx.Node] = {}
        copies: dict[int, list] = {k: [None] * len(self.members[2]) for k in range(3, count - 1)}
        last_of_group = {}
        for group in ([n for n in self.members[2] if n.op == "get_attr"],
                      [n for n in self.members[2] if n.op != "get_attr"]):
            if group:
                last_of_group[group[-1]] = group
        for node in self.source.nodes:
            position = self.block_of[node]
            if position == 3:   # the last block: what it reads of block 2 is block N-2's now
                def lookup(n):
                    return copies[count - 2][self.position[n]] if self.block_of[n] == 2 else env[n]
                env[node] = self._copy(out, node, lookup, 3, count - 1)
            elif position is None:
                env[node] = self._copy(out, node, env.__getitem__, None, None)
            else:
                env[node] = self._copy(out, node, env.__getitem__, position, position)
            if node in last_of_group:
                for k in range(3, count - 1):
                    self._copy_block(out, last_of_group[node], k, env, copies)
        return out

    def _copy_block(self, out: fx.Graph, group: list[fx.Node], k: int, env: dict, copies: dict) -> None:
        """Block 2's `group` of nodes as block k's: block 2's reads of block 1 become reads of block k-1."""
        def lookup(n):
            if self.block_of[n] == 2:
                return copies[k][self.position[n]]
            if self.block_of[n] == 1:
                before = copies.get(k - 1)
                return before[self.position[n]] if before is not None else env[self.members[2][self.position[n]]]
            return env[n]
        for node in group:
            copies[k][self.position[node]] = self._copy(out, node, lookup, 2, k)

    def _copy(self, out: fx.Graph, node: fx.Node, lookup, position: int | None, block: int | None) -> fx.Node:
        """`node` in `out` as block `block`'s (from the short export's block `position`; None: outside blocks)."""
        moved = position is not None and block != position
        if position is None:
            name = self._name(node, None, self.repeat.count - 1) if node in self.epilogue else node.name
        else:
            name = self._name(node, position, block) if moved else node.name
        target = node.target
        if moved and node.op == "get_attr":
            target = self._real(block) + target[len(self.prefix[position]):]
        new = out.create_node(node.op, target, fx.map_arg(node.args, lookup), fx.map_arg(node.kwargs, lookup),
                              name=name, type_expr=node.type)
        new.meta = copy.copy(node.meta)   # fake values are shared: the same shapes
        if moved and "nn_module_stack" in node.meta:
            old, real = self.prefix[position], self._real(block)
            new.meta["nn_module_stack"] = {_renamed_module(key, old, real, inside=True): (_renamed_module(fqn, old, real), kind)
                                           for key, (fqn, kind) in node.meta["nn_module_stack"].items()}
        return new


def _renamed_module(fqn: str, prefix: str, real: str, inside: bool = False) -> str:
    """fqn with the block's path replaced; inside=True: the path may follow a prefix (L__self__model.layers.2)."""
    if not inside:
        return real + fqn[len(prefix):] if fqn == prefix or fqn.startswith(prefix + ".") else fqn
    at = fqn.find(prefix)
    end = at + len(prefix)
    if at < 0 or (end < len(fqn) and fqn[end] != "."):
        return fqn
    return fqn[:at] + real + fqn[end:]


def _renamed_path(name: str, prefix: str, real: str) -> str:
    old, new = prefix.replace(".", "_") + "_", real.replace(".", "_") + "_"
    if not name.startswith(old):
        raise NotSpliceable(f"parameter node {name} is not named by its path")
    return new + name[len(old):]


def _split(name: str) -> tuple[str, int | None]:
    match = _NAME.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, None)


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, complex)) or type(value).__module__ == "torch"
