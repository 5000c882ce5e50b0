"""verify(gm, *inputs): run a converted graph and check that every value has the dtype the passes said.

    amp_compiler.verify(gm, x)   # None, or DtypeMismatch naming the first node whose real dtype differs

Cast insertion trusts meta["amp"]["dtype"]; a wrong entry means a missing cast (a crash) or a silently
different precision. Run it in tests and after changing rules.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from amp_compiler.converted import compiled_record, converted_graphs
from amp_compiler.insight.compare import describe_inputs, first_line
from amp_compiler.passes.fx.infer_dtypes import value_dtype
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.node_facts import facts


class DtypeMismatch(AssertionError):
    """A node computed a dtype other than the one recorded in its meta["amp"]["dtype"]."""


class _Checker(fx.Interpreter):
    def run_node(self, node: fx.Node):
        value = super().run_node(node)
        expected = facts(node).get("dtype")
        actual = value_dtype(value)
        if node.op not in ("output",) and expected is not None and actual is not None and actual != expected:
            amp = facts(node)
            raise DtypeMismatch(
                f"node {node.name} ({amp.get('op')}, module {amp.get('module') or '-'}) computed "
                f"{dtype_name(actual)} but the passes recorded {dtype_name(expected)} "
                f"(precision {amp.get('precision')}, rule: {amp.get('rule')}); the first mismatch in "
                "graph order")
        return value


def verify(gm: fx.GraphModule, *inputs, **kwargs) -> None:
    """Run `gm` on `inputs` and raise DtypeMismatch at the first node whose dtype is not the recorded one."""
    if (record := compiled_record(gm)) is not None:   # in place: every graph dynamo made, on what it receives
        record.verify(gm, inputs, kwargs)
        return
    graphs = converted_graphs(gm)
    if not graphs:
        raise ValueError("verify() needs a GraphModule returned by amp_compiler.convert()")
    if [graph for _, graph in graphs] != [gm]:   # the model's own forward runs as written: check each child
        _verify_while_running(gm, [graph for _, graph in graphs], inputs, kwargs)
        return
    flat = inputs
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):   # the graph's placeholders are the flat inputs
        flat = tuple(codegen.process_inputs(*inputs, *kwargs.values()))
    elif kwargs:
        flat = (*inputs, *kwargs.values())
    try:
        with torch.no_grad():
            _Checker(gm).run(*flat)
    except DtypeMismatch:
        raise
    except Exception as error:  # noqa: BLE001 - named with the inputs, in one line
        hint = ("; pass the inputs as separate arguments: verify(gm, *inputs)"
                if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) and not kwargs else "")
        raise ValueError(f"verify(): the converted graph fails on these inputs ({describe_inputs(inputs)}): "
                         f"{type(error).__name__}: {first_line(error)}{hint}") from error


def _verify_while_running(model, graphs: list, inputs, kwargs) -> None:
    """Each converted graph checked on what it receives while `model` runs."""
    handles = [gm.register_forward_pre_hook(lambda module, args, kw: verify(module, *args, **kw),
                                            with_kwargs=True) for gm in graphs]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
