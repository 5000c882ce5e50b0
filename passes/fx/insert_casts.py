"""Insert the casts that painting implies, one per (value, dtype), shared by every consumer.

    y = linear(x, w)               ->   x_f16 = amp_cast(x, float16); w_f16 = amp_cast(w, float16)
                                        y = linear(x_f16, w_f16)
Each painted node gets its float operands in its own precision; with keep_io_types the graph's outputs
get back the dtype the original model returned. Reads meta["amp"]["dtype"] (infer_dtypes after
painting) and ["precision"]; new cast nodes carry meta["amp_role"] = "cast".
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from amp_compiler.passes.fx.aliases import written_value, written_views
from amp_compiler.passes.fx.runtime import amp_cast, is_float
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.runner import PassResult
from amp_compiler.passes.node_facts import facts


def make_cast(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, why: str) -> fx.Node:
    cast = graph.call_function(amp_cast, (value, dtype))
    cast.meta["amp_role"] = "cast"
    cast.meta["amp"] = {"op": "cast", "class": "cast", "precision": None, "dtype": dtype,
                        "module": facts(value).get("module", ""), "rule": why}
    cast._rename(f"{value.name}_{dtype_name(dtype)}")  # unique within the graph
    return cast


def insert_casts(gm: fx.GraphModule, low: torch.dtype, original_output_dtypes: list,
                 keep_io_types: bool = True) -> PassResult:
    graph = gm.graph
    tied = first_reader_of_each_tensor(gm)
    shared: dict[tuple[fx.Node, torch.dtype, int], fx.Node] = {}
    writes: dict[fx.Node, int] = {}  # in-place writes seen so far: a cast made before one is stale after it
    inserted = 0

    def cast_of(value: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> fx.Node:
        nonlocal inserted
        value = tied.get(value, value)
        key = (value, dtype, writes.get(value, 0))
        if key not in shared:
            with graph.inserting_before(consumer):  # the first reader: later readers share it
                why = f"boundary: {value.name} ({dtype_name(value.meta['amp']['dtype'])}) read as {dtype_name(dtype)}"
                shared[key] = make_cast(graph, value, dtype, why)
            inserted += 1
        return shared[key]

    for node in list(graph.nodes):
        amp = facts(node)
        target = written_value(node)
        for written in written_views(node):   # a write through a view also changes its base
            writes[written] = writes.get(written, 0) + 1
        if amp.get("family") == "inplace":  # operands follow the written tensor, which is never cast
            want = facts(target).get("dtype") if target is not None else None
            operands = [v for v in node.all_input_nodes if v is not target]
        else:
            precision = amp.get("precision")
            want = {"low": low, "fp32": torch.float32}.get(precision)
            operands = list(node.all_input_nodes)
            if amp.get("fp32_weights"):  # mixed norm kernel: parameters and statistics are read in fp32,
                operands = [v for v in operands if not reads_as_norm_weight(node, v)]   # the data input low
        if not is_float(want):
            continue
        for value in operands:
            have = facts(value).get("dtype")
            if is_float(have) and have != want:
                node.replace_input_with(value, cast_of(value, want, node))

    if keep_io_types:
        output = next(n for n in graph.nodes if n.op == "output")
        outputs = output_value_nodes(gm)
        for value, original in zip(outputs, original_output_dtypes):
            have = facts(value).get("dtype")
            if is_float(have) and is_float(original) and have != original and not keeps_its_dtype(value):
                output.replace_input_with(value, _cast_in_its_grad_mode(graph, value, original, make_cast)
                                          if _grad_mode_changes_after(value) else cast_of(value, original, output))
    return PassResult(modified=inserted > 0, counts={"casts_inserted": inserted})


def _cast_in_its_grad_mode(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, make_cast) -> fx.Node:
    """An output's cast of its own right after the value: grad mode changes before the output (dynamo records
    `with torch.enable_grad():` as _set_grad_enabled calls), and a cast made there, or shared with a reader there,
    would return a tensor without the gradient the value has."""
    with graph.inserting_after(value):
        why = f"boundary: {value.name} ({dtype_name(value.meta['amp']['dtype'])}) returned as {dtype_name(dtype)}"
        return make_cast(graph, value, dtype, why)


def _grad_mode_changes_after(value: fx.Node) -> bool:
    node = value.next
    while node.op != "output":
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            return True
        node = node.next
    return False


STATE_OUTPUT = "amp_state_output"   # node meta: a value the graph stores into model state (a KV cache), not returns


def keeps_its_dtype(value: fx.Node) -> bool:
    """A graph output keep_io_types leaves in its computed dtype: a front end marked it as state the model stores
    for its own next calls (dynamo: a KV cache's tensors), which autocast keeps low too."""
    return bool(value.meta.get(STATE_OUTPUT))


def first_reader_of_each_tensor(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """get_attr node -> the first get_attr node that reads the same tensor: tied weights (an embedding and
    the output layer, torch.export's names for one parameter) get one cast per forward, not one per name."""
    first: dict[int, fx.Node] = {}
    tied: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = operator.attrgetter(node.target)(gm)
            tied[node] = first.setdefault(id(tensor), node)
    return tied


def output_value_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The distinct nodes the graph returns, in order."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    found: list[fx.Node] = []
    fx.node.map_arg(output.args, lambda n: found.append(n) if n not in found else None)
    return found


def reads_as_norm_weight(norm: fx.Node, value: fx.Node) -> bool:
    """Whether a mixed norm kernel reads `value` as a weight or statistic (fp32), not as its data input.
    The data input is the first argument of every norm op; it can be a parameter too (DeBERTa-v3 normalises
    its relative-position table, a weight, and reads the result as an activation). A weight is module state: a
    get_attr, or a placeholder where the front end passes state as graph inputs (TorchDynamo: batch norm's running
    statistics cast low there would take its in-place update away from the model's buffers)."""
    return value.op in ("get_attr", "placeholder") and not (norm.args and norm.args[0] is value)
