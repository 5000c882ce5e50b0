"""Every zoo model at every level in both dtypes: converts, matches fp32, trains one step."""
import pytest
import torch

from amp_compiler import convert, explain
from amp_testing import assert_cast_invariants, assert_close_to_fp32
from models import ZOO_NAMES, build

pytestmark = pytest.mark.slow  # every zoo model converted and trained at every level: 62 s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_converts_matches_fp32_and_trains(name, level, dtype):
    task = build(name, size="small", seed=0)
    model = task.model
    gm = convert(model, level, dtype=dtype, example_inputs=task.example_inputs)
    gm.graph.lint()
    assert_cast_invariants(gm)
    report = explain(gm)
    assert report.totals["unknown_ops"] == []
    if level == "O0":
        assert report.totals["casts"] == 0
    else:
        assert report.totals["nodes_per_dtype"].get(str(dtype).removeprefix("torch."), 0) > 0

    model.eval(), gm.eval()
    with torch.no_grad():
        reference, output = model(*task.example_inputs), gm(*task.example_inputs)
    assert output.dtype == reference.dtype  # keep_io_types
    assert_close_to_fp32(output, reference, dtype if level != "O0" else torch.float32)

    gm.train()
    inputs, target = task.make_batch(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    loss = task.loss_fn(gm(*inputs), target)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all())
               for p in model.parameters())
    optimizer.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
