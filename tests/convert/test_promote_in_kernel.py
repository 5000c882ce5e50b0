"""promote_in_kernel: an fp32 add/sub/mul/div reads its low operand directly (torch's type promotion
upcasts as the kernel reads), so no fp32 copy is written; the result and the gradients are bitwise those
of cast-then-op. Where promotion would not give fp32 (a 0-dim fp32 operand), the cast stays."""
import torch
import torch.nn.functional as F
from torch import nn

import amp_compiler
from amp_compiler.passes.fx.runtime import is_cast
from models import build


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x):
        return x + self.lin(x), self.lin(x) * self.scale   # a dimensioned fp32 operand; a 0-dim one


def _casts_into(gm, op_name):
    return [n for n in gm.graph.nodes if n.name == op_name for a in n.all_input_nodes if is_cast(a)]


def test_a_residual_add_reads_the_low_value_and_matches_cast_then_add_bitwise():
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(4, 16, requires_grad=True)
    gm = amp_compiler.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), force_fp32=["add"])
    assert not _casts_into(gm, "add")                    # the add reads the bf16 linear output
    rule = next(row["rule"] for row in amp_compiler.explain(gm).rows if row["node"] == "add")
    assert "reads linear uncast (type promotion)" in rule, rule
    assert len(_casts_into(gm, "mul")) == 1              # 0-dim scale: bf16 * fp32 scalar tensor would be bf16
    residual, scaled = gm(x)
    (residual.sum() + scaled.sum()).backward()

    reference_x = x.detach().clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (model.lin.weight, model.lin.bias))
    x_low, w_low, b_low = reference_x.bfloat16(), w.bfloat16(), b.bfloat16()   # the graph, written out,
    expected_residual = reference_x + F.linear(x_low, w_low, b_low).float()      # with the cast the pass removed
    expected_scaled = F.linear(x_low, w_low, b_low).float() * model.scale
    (expected_residual.sum() + expected_scaled.sum()).backward()
    assert residual.dtype == scaled.dtype == torch.float32
    assert torch.equal(residual, expected_residual) and torch.equal(scaled, expected_scaled)
    assert torch.equal(x.grad, reference_x.grad)
    assert torch.equal(model.lin.weight.grad, w.grad) and torch.equal(model.lin.bias.grad, b.grad)


def test_placement_does_not_move_nodes_to_shrink_a_cast_the_kernel_makes_unnecessary():
    """GCN: messages gathered in bf16 are scaled by an fp32 norm; placement once moved the gather to fp32
    (a 3.4 MB cast -> 0.7 MB) though promotion needs no cast at all: 6 casts against painting's 4."""
    task = build("gcn", size="small")
    task.model.eval()
    placed = amp_compiler.convert(task.model, "O1", dtype=torch.bfloat16, example_inputs=task.example_inputs)
    painted = amp_compiler.convert(task.model, "O1", dtype=torch.bfloat16, example_inputs=task.example_inputs,
                                   cast_placement=False)
    count = lambda gm: sum(is_cast(n) for n in gm.graph.nodes)   # noqa: E731
    assert count(placed) <= count(painted)
    with torch.no_grad():
        assert torch.equal(placed(*task.example_inputs), painted(*task.example_inputs))
