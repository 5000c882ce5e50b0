"""fx/calibrate_ranges.py: record_ranges runs the fp32 graph on each sample in eval mode and writes each node's
figures (max |x|, samples past the low dtype's largest number, its largest input, the share below normal)."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from amp_compiler.passes.fx.calibrate_ranges import record_ranges
from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.node_facts import facts


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        big = x * 1e5            # past fp16's 65504 when |x| > 0.65504
        return self.fc(big / 1e5), F.dropout(x, 0.5, training=True) * 1e-6


def graph(model=None) -> fx.GraphModule:
    gm = fx.symbolic_trace(model or Scaled())
    canonicalize(gm)
    return gm


def test_each_node_gets_its_figures_over_the_samples():
    gm = graph()
    samples = [(torch.full((2, 4), 2.0),), (torch.full((2, 4), 0.1),), torch.full((2, 4), 3.0)]   # a bare tensor too
    result = record_ranges(gm, samples, torch.float16)
    ranges = {n.name: facts(n).get("range") for n in gm.graph.nodes}
    assert ranges["mul"] == {"samples": 3, "max_abs": pytest.approx(3e5), "overflows": 2, "read_max": 3.0,
                             "read_from": "x", "below_normal": 0.0}
    assert ranges["truediv"]["overflows"] == 2 and ranges["truediv"]["read_from"] == "mul"   # reads an overflow
    assert ranges["truediv"]["max_abs"] == pytest.approx(3.0)
    assert ranges["fc"]["overflows"] == 0
    assert ranges["mul_1"]["below_normal"] == 1.0   # 1e-6 .. 3e-6: all under fp16's 6.1e-5
    assert ranges["output"] is None
    assert result.counts == {"samples": 3, "nodes_overflowing": 2} and not result.modified


def test_in_bf16_nothing_overflows_and_nothing_is_below_normal():
    gm = graph()
    record_ranges(gm, [(torch.full((2, 4), 3.0),)], torch.bfloat16)
    assert all(facts(n)["range"]["overflows"] == 0 and facts(n)["range"]["below_normal"] == 0.0
               for n in gm.graph.nodes if "range" in facts(n))


def test_the_graph_runs_in_eval_mode_with_baked_in_dropout_as_its_input_and_training_is_restored():
    gm = graph()
    gm.train()
    record_ranges(gm, [(torch.ones(2, 4),)], torch.float16)
    dropout = next(n for n in gm.graph.nodes if facts(n).get("op") == "dropout")
    assert facts(dropout)["range"]["max_abs"] == 1.0   # not 2.0: dropout(training=True) would scale by 1/(1-p)
    assert gm.training and gm.fc.training


def test_a_sample_that_fails_names_its_index_and_the_node():
    with pytest.raises(ValueError, match=r"calibration_data sample 1 \(float32\[2, 5\]\) fails at node fc "
                                         r"\(module 'fc'\): RuntimeError"):
        record_ranges(graph(), [(torch.ones(2, 4),), (torch.ones(2, 5),)], torch.float16)


def test_no_samples_is_an_error():
    with pytest.raises(ValueError, match="calibration_data gave no samples"):
        record_ranges(graph(), [], torch.float16)
    with pytest.raises(TypeError, match="must be an iterable of input tuples"):
        record_ranges(graph(), torch.ones(3, 4), torch.float16)
