"""Runtime evidence: the dtypes ATen ops actually receive when the converted graph runs."""
import pytest
import torch

from amp_compiler import convert
from amp_testing import AtenDtypeRecorder, WithLoss
from models import ZOO_NAMES, build

pytestmark = pytest.mark.slow  # the zoo's ATen calls recorded at O1: 16 s

MATMUL_CONV = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution")
MIXED_NORMS = ("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
               "_native_batch_norm_legit_no_training", "native_group_norm")
SOFTMAX_LOSS = ("_softmax", "_log_softmax", "nll_loss_forward", "nll_loss2d_forward", "mse_loss",
                "binary_cross_entropy_with_logits")
NORM_SOFTMAX_LOSS = MIXED_NORMS + SOFTMAX_LOSS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_o1_runs_matmuls_low_softmax_losses_fp32_and_norms_with_fp32_weights(name, dtype):
    task = build(name, size="small")
    inputs, target = task.make_batch(0)
    model = WithLoss(task.model, task.loss_fn)
    gm = convert(model, "O1", dtype=dtype, example_inputs=(*inputs, target))
    recorder = AtenDtypeRecorder()
    with recorder:
        loss = gm(*inputs, target)
        loss.backward()
    matmul_dtypes = recorder.input_dtypes(*MATMUL_CONV)
    assert matmul_dtypes == {dtype}, f"matmul/conv inputs ran in {matmul_dtypes}"
    fragile = recorder.input_dtypes(*SOFTMAX_LOSS)
    assert fragile == {torch.float32}, f"softmax/loss inputs ran in {fragile}"
    # Norms are mixed kernels at O1 (tests/convert/test_mixed_norms.py): activations in their producer's dtype,
    # weights and statistics always fp32.
    norm_calls = [dtypes for op in MIXED_NORMS for dtypes in recorder.calls.get(op, [])]
    assert all(set(d[1:]) <= {torch.float32} and d[0] in (dtype, torch.float32) for d in norm_calls), norm_calls
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_o0_runs_everything_fp32():
    task = build("bert", size="small")
    gm = convert(task.model, "O0")
    recorder = AtenDtypeRecorder()
    with recorder:
        gm(*task.example_inputs)
    assert recorder.input_dtypes(*MATMUL_CONV, *NORM_SOFTMAX_LOSS) == {torch.float32}


@pytest.mark.parametrize("name, norm_ops", [("resnet", ("native_batch_norm", "_native_batch_norm_legit")),
                                             ("bert", ("native_layer_norm",))])
def test_o2_norms_read_low_activations_with_fp32_weights(name, norm_ops):
    task = build(name, size="small")
    gm = convert(task.model, "O2", dtype=torch.bfloat16)
    recorder = AtenDtypeRecorder()
    with recorder:
        gm(*task.example_inputs)
    calls = [dtypes for op in norm_ops for dtypes in recorder.calls.get(op, [])]
    assert calls and all(d[0] == torch.bfloat16 and set(d[1:]) == {torch.float32} for d in calls)


def test_o3_runs_norms_low_too():
    task = build("resnet", size="small")
    gm = convert(task.model, "O3", dtype=torch.bfloat16)
    recorder = AtenDtypeRecorder()
    with recorder:
        gm(*task.example_inputs)
    assert recorder.input_dtypes(*MATMUL_CONV) == {torch.bfloat16}
    # batch norm takes bf16 activations; its fp32 parameters/statistics ride along (mixed kernel).
    assert torch.bfloat16 in recorder.input_dtypes("native_batch_norm", "_native_batch_norm_legit")
