"""fx/propagate_values.py: a fake value per node from fake example inputs; nodes that need real data (and
their readers) get none without an error; example inputs that do not fit the model are a ValueError naming
the input and the node; the user's buffers are not touched."""
import logging

import pytest
import torch
import torch.fx as fx
from torch import nn

from amp_compiler.passes.fx.canonicalize import canonicalize
from amp_compiler.passes.fx.propagate_values import propagate_values


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x, scale):
        return self.bn(self.fc(x)).relu() * scale.half()


def traced(model) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    canonicalize(gm)   # the pipeline runs it first; example_inputs_error names the op from it
    return gm


def test_every_node_gets_a_fake_value_with_its_shape_and_dtype():
    model = Net().train()
    gm = traced(model)
    result = propagate_values(gm, (torch.randn(3, 8), torch.tensor(2.0)))
    values = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    assert not result.modified and result.counts == {"values_propagated": len(values) - 1}   # all but the output
    assert "val" not in next(n for n in gm.graph.nodes if n.op == "output").meta
    assert values["fc"].shape == (3, 4) and values["fc"].dtype == torch.float32
    assert values["half"].dtype == torch.float16 and values["mul"].dtype == torch.float32   # promotion
    assert isinstance(values["mul"], torch._subclasses.fake_tensor.FakeTensor)
    assert model.bn.num_batches_tracked.item() == 0   # a train-mode BatchNorm counted no step on the real buffer
    assert torch.equal(model.bn.running_mean, torch.zeros(4))


class DataDependent(nn.Module):
    def forward(self, x):
        return x.nonzero().float().sum() + x.sum()


def test_a_node_that_needs_real_data_and_its_readers_get_no_value_and_nothing_is_raised():
    gm = traced(DataDependent())
    propagate_values(gm, (torch.randn(4),))
    has = {n.name: "val" in n.meta for n in gm.graph.nodes if n.op != "output"}
    assert has == {"x": True, "nonzero": False, "float_1": False, "sum_1": False, "sum_2": True, "add": False}


def test_inputs_of_the_wrong_width_are_an_error_naming_the_node():
    with pytest.raises(ValueError, match=r"example_inputs \(x: float32\[3, 5\], scale: float32\[\]\) do not fit "
                                         r"the model: linear \(node fc, module 'fc'\) fails on them"):
        propagate_values(traced(Net()), (torch.randn(3, 5), torch.tensor(2.0)))


class UsesItsInputEarly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, y):
        return self.fc(x.relu()) + y   # x's last reader is relu: the interpreter frees it before fc runs


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_the_error_describes_an_input_whose_last_reader_ran_before_the_failing_node():
    fake_tensor_log, records = logging.getLogger("torch._subclasses.fake_tensor"), _Records()
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.NOTSET)   # as a fresh process has it (the CLI's tests raise it)
    fake_tensor_log.addHandler(records)   # torch's own handler holds the stderr of import time: watch the logger
    try:
        with pytest.raises(ValueError, match=r"example_inputs \(x: float32\[3, 5\], y: float32\[3, 4\]\) do not fit"):
            propagate_values(traced(UsesItsInputEarly()), (torch.randn(3, 5), torch.randn(3, 4)))
    finally:
        fake_tensor_log.removeHandler(records)
        after, _ = fake_tensor_log.level, fake_tensor_log.setLevel(level)
    # torch's log of the failed fake kernel (a traceback) is not printed above the one clear error
    assert not [r for r in records.records if r.levelno >= logging.WARNING]
    assert after == logging.NOTSET   # and the logger is left as it was


def test_an_integer_input_into_a_linear_says_to_give_floats():
    with pytest.raises(ValueError, match=r"example input 0 \('x', int64\[3, 8\]\) reaches linear \(node fc, module "
                                         r"'fc'\), which needs a floating-point tensor"):
        propagate_values(traced(Net()), (torch.ones(3, 8, dtype=torch.int64), torch.tensor(2.0)))


def test_a_wrong_number_of_inputs_propagates_nothing():
    gm = traced(Net())
    assert propagate_values(gm, (torch.randn(3, 8),)).counts == {"values_propagated": 0}
    assert not any("val" in n.meta for n in gm.graph.nodes)
