"""Record node.meta["val"], a fake value per node, by running the graph on fake example inputs.

    propagate_values(gm, (x,))   ->   every node it could run carries meta["val"] (shape and dtype, no data)

torch.export graphs already carry these; this gives fx graphs the same facts when example inputs are
known, so infer_dtypes reads dtypes rather than deriving them. A node that cannot run on fake tensors
(data-dependent output shapes, an opaque body that needs real data) gets no value, nor do the nodes
that read it: infer_dtypes falls back to its rules there. A node that fails for another reason may be
refusing the example inputs themselves (an int64 input into a Linear, a wrong width): the graph then runs
once on the real inputs, and if it fails there too, the example inputs are wrong and a ValueError names the
input and the node (example_inputs_error); if it runs, fake tensors were the limit and nothing is raised.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from amp_compiler.passes.node_facts import facts
from amp_compiler.passes.policy.numerics import dtype_name
from amp_compiler.passes.policy.op_policy import POLICY
from amp_compiler.passes.runner import PassResult

# Failures that say "fake tensors cannot know this", never "these inputs are wrong".
NEEDS_REAL_DATA = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                   GuardOnDataDependentSymNode)


class _Unknown:
    """Stands for a value that could not be computed."""


class _FakePropagator(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.failed: fx.Node | None = None   # the first node that failed for a reason other than data

    def run_node(self, node: fx.Node):
        unknown = []
        fx.node.map_arg((node.args, node.kwargs),
                        lambda n: unknown.append(n) if isinstance(self.env.get(n), _Unknown) else None)
        if unknown:
            return _Unknown()
        try:
            value = super().run_node(node)
        except Exception as error:  # noqa: BLE001 - one node that needs real data must not stop the rest
            if self.failed is None and not isinstance(error, NEEDS_REAL_DATA):
                self.failed = node
            return _Unknown()
        if node.op != "output":
            node.meta["val"] = value
        return value


class _RealRun(fx.Interpreter):
    """Runs the graph on real inputs; on failure, says which node failed with the values it read."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)   # the error below describes every input it read
        self.extra_traceback = False   # the error below names the node itself

    def run_node(self, node: fx.Node):
        try:
            return super().run_node(node)
        except Exception as error:  # noqa: BLE001 - named below, with the node and the inputs
            raise example_inputs_error(self.module, node, error, self.env) from error


class _Propagate(torch.nn.Module):
    """Runs an interpreter as a module call, so functional_call can swap in fake (or copied) buffers."""

    def __init__(self, gm: fx.GraphModule, interpreter: type):
        super().__init__()
        self.gm, self.interpreter, self.run = gm, interpreter, None

    def forward(self, *inputs):
        self.run = self.interpreter(self.gm)
        return self.run.run(*inputs)


def propagate_values(gm: fx.GraphModule, example_inputs: tuple) -> PassResult:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    fake_inputs = torch.utils._pytree.tree_map(fake, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fake_inputs):
        return PassResult(modified=False, counts={"values_propagated": 0})
    runner = _Propagate(gm, _FakePropagator)
    # Fake parameters and buffers too: a train-mode BatchNorm's `num_batches_tracked.add_(1)` would
    # otherwise count a step on the user's real buffer each time a model is converted.
    state = {name: fake(t) for name, t in (*runner.named_parameters(remove_duplicate=False),
                                           *runner.named_buffers(remove_duplicate=False))}
    with mode, torch.no_grad(), _fake_tensor_log_quieted():
        torch.func.functional_call(runner, state, fake_inputs, tie_weights=False)
    if runner.run.failed is not None or _integer_read_by_float_op(gm):
        _run_on_real_inputs(gm, example_inputs)   # raises when the example inputs are what fails
    known = sum("val" in n.meta for n in gm.graph.nodes)
    return PassResult(modified=False, counts={"values_propagated": known})


@contextlib.contextmanager
def _fake_tensor_log_quieted():
    """torch logs each failed fake kernel with its traceback; here every failure is handled (retried on the real
    inputs, or the error below names the input and the node), so that log would only bury the one clear line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_on_real_inputs(gm: fx.GraphModule, example_inputs: tuple) -> None:
    runner = _Propagate(gm, _RealRun)
    copies = {name: t.clone() for name, t in runner.named_buffers(remove_duplicate=False)}   # the user's stay
    with torch.no_grad(), torch.random.fork_rng(devices=[]):   # a train-mode dropout draws from its own RNG copy
        torch.func.functional_call(runner, copies, tuple(example_inputs), tie_weights=False)


def example_inputs_error(gm: fx.GraphModule, node: fx.Node, error: Exception, env: dict) -> ValueError:
    """What to tell the user when `node` fails on the example inputs: the input to change and why."""
    from amp_compiler.passes.fx.decide_precision import module_path   # imports this module's neighbours

    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    module = module_path(node)
    where = f"{facts(node).get('op', node.target)} (node {node.name}" + (f", module {module!r})" if module else ")")
    integer = _integer_input_read(node, env)
    rule = POLICY.get(facts(node).get("op"))
    if integer is not None and rule is not None and rule.op_class == "allow":
        return ValueError(f"example input {inputs.index(integer)} ({integer.target!r}, {_describe(env[integer])}) "
                          f"reaches {where}, which needs a floating-point tensor: give example_inputs in the "
                          "dtype the model will be called with (x.float())")
    given = ", ".join(f"{n.target}: {_describe(env.get(n))}" for n in inputs)
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return ValueError(f"example_inputs ({given}) do not fit the model: {where} fails on them: "
                      f"{type(error).__name__}: {first_line}")


def _integer_read_by_float_op(gm: fx.GraphModule) -> bool:
    """An allow op (linear, conv, matmul) reads an integer value that came from a graph input: fake kernels
    may accept what the real one refuses (an int64 input into a Linear)."""
    values = {n: n.meta.get("val") for n in gm.graph.nodes}
    return any(_integer_input_read(node, values) is not None for node in gm.graph.nodes
               if getattr(POLICY.get(facts(node).get("op")), "op_class", None) == "allow")


def _integer_input_read(node: fx.Node, env: dict) -> fx.Node | None:
    """The graph input with an integer value that reaches `node` through integer values only, if any."""
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        source = stack.pop()
        value = env.get(source)
        if source in seen or not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
            continue
        seen.add(source)
        if source.op == "placeholder":
            return source
        stack.extend(source.all_input_nodes)
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)}{list(value.shape)}"
    return type(value).__name__
