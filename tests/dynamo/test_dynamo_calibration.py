"""calibration_data on TorchDynamo's capture (amp_compiler/dynamo/calibration.py): every graph is calibrated on the
tensors it received while the samples ran, graphs dynamo makes later on their frame's recorded calls."""
import copy

import pytest
import torch
from torch import nn

import amp_compiler
from amp_compiler.dynamo import graphs
from amp_compiler.converted import compiled_record

_SEEDED = torch.Generator().manual_seed(0)
SAMPLES = [(torch.randn(4, 16, generator=_SEEDED),), (torch.randn(4, 16, generator=_SEEDED) * 3e4,)]   # 2nd: past fp16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def calibrated(model, samples=SAMPLES, **options):
    return amp_compiler.convert(model, "O1", dtype=torch.float16, inplace=True, calibration_data=samples, **options)


def calibration_counts(gm):
    return gm.meta["amp"]["pass_counts"].get("calibrate_ranges")


def test_the_graphs_the_samples_make_keep_what_overflows_fp32_as_convert_does():
    whole = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, calibration_data=SAMPLES)
    model, fp32 = mlp(), mlp()
    calibrated(model)
    assert compiled_record(model) is not None and len(graphs(model)) == 1   # made by the samples, before any call
    x = SAMPLES[1][0]   # values the calibration saw
    with torch.no_grad():
        out, expected = model(x), fp32(x)
    assert torch.isfinite(out).all()   # the first linear's 3e4-scaled input stays fp32
    assert (out - expected).abs().max() <= 1e-2 * expected.abs().max()
    uncalibrated = amp_compiler.convert(mlp(), "O1", dtype=torch.float16, inplace=True)
    with torch.no_grad():
        assert not torch.isfinite(uncalibrated(x)).all()   # without calibration it overflows
    line = next(line for line in str(amp_compiler.explain(whole)).splitlines() if line.startswith("range calibration"))
    assert line.rpartition(":")[0] in str(amp_compiler.explain(model))   # "range calibration (2 samples): 1 node kept fp32"


def test_graphs_made_later_read_their_frames_recorded_calls():
    model = calibrated(mlp())
    with torch.no_grad():
        model(torch.randn(8, 16))    # another batch size: dynamo's shape-generic graph, its size a placeholder
        model(torch.randn(12, 16))   # the same graph
    model.train()
    model(torch.randn(4, 16))        # training flags and grad mode: another graph
    assert len(graphs(model)) == 3
    sizes = [n for n in graphs(model)[1].graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.SymInt)]
    assert sizes   # which no call of the samples' (static) graph had: read off the input's size
    assert [calibration_counts(gm) for gm in graphs(model)] == [{"samples": 2, "nodes_overflowing": 2}] * 3
    assert "converted uncalibrated" not in str(amp_compiler.explain(model))


class BreaksWhenTraining(nn.Module):
    """One graph in eval mode; in training a graph break inside forward, so dynamo compiles forward's own frame and
    a resumed one: frames no eval-mode sample reached."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        y = self.first(x)
        if self.training:
            torch._dynamo.graph_break()
        return self.second(y * 2)


def test_a_frame_no_sample_reached_is_converted_uncalibrated_and_said():
    model = calibrated(BreaksWhenTraining().eval())
    model.train()
    model(torch.randn(4, 16))
    assert [calibration_counts(gm) is not None for gm in graphs(model)] == [True, False, False]
    text = str(amp_compiler.explain(model))
    assert "calibration: graph of first (compile id" in text and "calibration: graph of second (compile id" in text
    assert text.count("converted uncalibrated") == 2


def test_samples_change_no_buffer_and_a_failing_sample_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    statistics = model[1].running_mean.clone()
    calibrated(model)
    assert torch.equal(model[1].running_mean, statistics) and model[1].num_batches_tracked == 0
    fresh = mlp()
    with pytest.raises(ValueError, match="calibration_data sample 0: the model fails on it"):
        calibrated(fresh, [(torch.randn(4, 5),)])
    assert compiled_record(fresh) is None and "forward" not in fresh.__dict__


def test_a_deepcopy_of_a_calibrated_model_calibrates_its_own_graphs():
    model = calibrated(mlp())
    copied = copy.deepcopy(model)
    x = SAMPLES[1][0]
    with torch.no_grad():
        assert torch.isfinite(copied(x)).all()
    assert calibration_counts(graphs(copied)[0]) == {"samples": 2, "nodes_overflowing": 2}
