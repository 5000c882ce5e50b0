"""Activation checkpointing under amp_compiler.compile: a checkpointed block's body is converted (its matmuls low)
and still recomputed in the backward as torch.utils.checkpoint does it outside dynamo (amp_compiler/dynamo/bodies.py)."""
import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.passes.node_facts import facts

MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Checkpointed(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        if self.how == "sequential":
            x = checkpoint.checkpoint_sequential(self.blocks, 3, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class MatmulsRun(TorchDispatchMode):
    """The (op, dtype of its first matrix) of every matmul run while active."""

    def __init__(self):
        super().__init__()
        self.runs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            matrix = args[1] if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else args[0]
            self.runs.append((func.overloadpacket.__name__, matrix.dtype))
        return func(*args, **(kwargs or {}))


def step(model, inputs: dict, region=contextlib.nullcontext) -> tuple[int, list]:
    """(bytes autograd saved for the backward that are no parameter's, the matmuls the backward ran)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), region():
        out = model(**inputs)
    loss = (out.loss if hasattr(out, "loss") else out.float().pow(2).mean())
    with MatmulsRun() as backward:
        loss.backward()
    return sum(saved.values()), backward.runs


def autocast():
    return torch.autocast("cpu", torch.bfloat16)


def body_matmul_precisions(model) -> list:
    """The precision of each matmul node of the checkpoint bodies of the model's graphs."""
    return [facts(n).get("precision") for gm in graphs(model) for sub in gm.modules()
            if isinstance(sub, torch.fx.GraphModule) and sub.meta.get("amp", {}).get("body_of") == "checkpoint"
            for n in sub.graph.nodes if facts(n).get("family") in ("matmul", "attention")]


@pytest.mark.parametrize("how", ["checkpoint", "sequential"])
def test_a_checkpointed_block_runs_low_and_recomputes_as_autocast_with_checkpointing_does(how):
    torch.manual_seed(0)
    model, inputs = Checkpointed(how), {"x": torch.randn(64, 32)}
    reference = copy.deepcopy(model)
    expected_bytes, expected_matmuls = step(reference, inputs, autocast)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    saved_bytes, matmuls = step(model, inputs)
    precisions = body_matmul_precisions(model)   # one graph, each checkpointed segment's body inside it
    assert len(graphs(model)) == 1, graphs(model)   # checkpoint_sequential was a graph break: blocks recomputed fp32
    # 3 blocks x 2 linears; checkpoint_sequential's last segment (one block) is not checkpointed
    assert precisions == ["low"] * (6 if how == "checkpoint" else 4), precisions
    assert matmuls == expected_matmuls, (matmuls, expected_matmuls)   # the same recomputation, in bf16
    assert saved_bytes <= 1.1 * expected_bytes, (saved_bytes, expected_bytes)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0.05, atol=0.02)


def test_hugging_face_gradient_checkpointing_recomputes_each_layer_in_bf16():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (2, 16))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    reference = copy.deepcopy(model)
    expected_bytes, expected_matmuls = step(reference, inputs, autocast)
    no_checkpointing = copy.deepcopy(model)
    no_checkpointing.gradient_checkpointing_disable()
    _, matmuls_without = step(no_checkpointing, inputs, autocast)
    assert len(expected_matmuls) > len(matmuls_without)   # the reference does recompute
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    saved_bytes, matmuls = step(model, inputs)
    precisions = body_matmul_precisions(model)
    assert len(precisions) >= 2 * 7 and set(precisions) == {"low"}, precisions   # 7 linears (+ sdpa) a layer
    assert len(matmuls) == len(expected_matmuls), (len(matmuls), len(expected_matmuls))
    assert {dtype for _, dtype in matmuls} == {torch.bfloat16}
    assert saved_bytes <= 1.1 * expected_bytes, (saved_bytes, expected_bytes)
    assert model.is_gradient_checkpointing


def test_a_fallback_runs_the_checkpoint_bodies_as_captured(monkeypatch):
    """The passes convert a checkpoint body in place: a failure after that must not leave the autocast fallback
    running a half-converted body."""
    import amp_compiler.dynamo.backend as backend
    from amp_compiler.dynamo.backend import ConversionFallbackWarning
    from amp_compiler.passes.fx.runtime import amp_cast

    def failing(gm):
        raise RuntimeError("late failure")
    monkeypatch.setattr(backend, "call_bodies_directly", failing)   # after the bodies were converted
    torch.manual_seed(0)
    model, x = Checkpointed("checkpoint"), torch.randn(8, 32)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    made = []
    original = backend.under_autocast.__init__

    def recording(self, gm, *args, **kwargs):
        made.append(gm)
        original(self, gm, *args, **kwargs)
    monkeypatch.setattr(backend.under_autocast, "__init__", recording)
    amp_compiler.compile(model, "O1", dtype=torch.bfloat16, backend="eager")
    with torch.no_grad(), pytest.warns(ConversionFallbackWarning, match="late failure"):
        out = model(x)
    torch.testing.assert_close(out, expected)
    body_nodes = [n for gm in made for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule) and sub is not gm
                  for n in sub.graph.nodes]
    assert body_nodes and not any(n.target is amp_cast for n in body_nodes)
