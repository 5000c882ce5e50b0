"""O2 fp16 on a Llama trains: build_train_network applies the steps torch.autocast + GradScaler applies, and
its loss follows fp32's. Before the model's upcast in LlamaRMSNorm was honoured (and hand-written norms kept
fp32), every step was skipped: pow(rsqrt_out, 3) in the norm's fp16 backward overflowed (rsqrt 22-50 at init)."""
import pytest
import torch
import torch.nn.functional as F

from amp_compiler import build_train_network
from amp_testing import one_torch_thread

VOCAB, LENGTH, BATCH, LR = 96, 16, 4, 3e-3


def _llama(tied: bool, rope: str):
    import transformers
    torch.manual_seed(0)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0} if rope == "default" else \
        {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, tie_word_embeddings=tied, rope_parameters=rope_parameters)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).train()


def _batches(steps: int):
    """Counting sequences from random starts: the next token is learnable (start + i + 1)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = (torch.randint(0, VOCAB, (BATCH, 1), generator=generator) + torch.arange(LENGTH + 1)) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def loss_fn(out, label):
    return F.cross_entropy(out.logits.flatten(0, 1), label.flatten())


def _o2_fp16(tied: bool, rope: str, steps: int) -> tuple[list[float], list[bool]]:
    """The losses and which steps were skipped."""
    model = _llama(tied, rope)
    step = build_train_network(model, torch.optim.AdamW(model.parameters(), lr=LR), loss_fn, level="O2",
                               dtype=torch.float16, example_inputs=(next(_batches(1))[0],))
    results = [step(x, y) for x, y in _batches(steps)]
    return [loss.item() for loss, _, _ in results], [bool(overflow) for _, overflow, _ in results]


def _autocast_skips(tied: bool, rope: str, steps: int) -> int:
    model = _llama(tied, rope)
    optimizer, scaler = torch.optim.AdamW(model.parameters(), lr=LR), torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    skipped = 0
    for x, y in _batches(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale
    return skipped


def _fp32_losses(tied: bool, rope: str, steps: int) -> list[float]:
    model = _llama(tied, rope)
    optimizer, losses = torch.optim.AdamW(model.parameters(), lr=LR), []
    for x, y in _batches(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model's kernels are faster on one thread than on two cores others share (autocast fp16: 4x)."""
    with one_torch_thread():
        yield


def test_o2_fp16_llama_applies_autocasts_steps_and_trains_within_2_percent_of_fp32():
    o2, skipped = _o2_fp16(False, "default", 100)
    assert sum(skipped[:20]) <= _autocast_skips(False, "default", 20), f"O2 fp16 skipped {sum(skipped[:20])} of 20 steps"
    fp32 = _fp32_losses(False, "default", 100)
    assert fp32[-1] < 0.2 * fp32[0], f"the task is not learnt in fp32: {fp32[0]:.3f} -> {fp32[-1]:.3f}"
    mean_o2, mean_fp32 = sum(o2) / len(o2), sum(fp32) / len(fp32)
    assert abs(mean_o2 - mean_fp32) <= 0.02 * mean_fp32, (mean_o2, mean_fp32, sum(skipped))


@pytest.mark.slow
def test_o2_fp16_tied_llama3_rope_applies_autocasts_steps():
    _, skipped = _o2_fp16(True, "llama3", 20)
    assert sum(skipped) <= _autocast_skips(True, "llama3", 20), f"O2 fp16 skipped {sum(skipped)} of 20 steps"
