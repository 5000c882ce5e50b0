"""GPT-style causal decoder trained as a next-token language model.

The synthetic language follows a fixed random successor table: each token is
followed by its successor with probability ``1 - noise``, otherwise by a
uniformly random token, so sequences cycle through repeating patterns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import FIXED_DATA_STEP, ZooTask, batch_generator
from .transformer import TokenAndPositionEmbedding, TransformerBlock


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_length: int
    dim: int
    num_heads: int
    num_layers: int
    feed_forward_dim: int
    batch_size: int
    dropout: float = 0.1
    noise: float = 0.1


CONFIGS = {
    "small": GPTConfig(vocab_size=32, seq_length=16, dim=32, num_heads=2, num_layers=2, feed_forward_dim=64, batch_size=16),
    "full": GPTConfig(vocab_size=512, seq_length=64, dim=128, num_heads=4, num_layers=4, feed_forward_dim=512, batch_size=32),
}


class GPTLanguageModel(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.embedding = TokenAndPositionEmbedding(config.vocab_size, config.seq_length, config.dim)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(
                config.dim,
                config.num_heads,
                config.feed_forward_dim,
                config.dropout,
                norm_first=True,
                causal_max_length=config.seq_length,
            )
            for _ in range(config.num_layers)
        )
        self.final_norm = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding_dropout(self.embedding(token_ids))
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(self.final_norm(hidden))  # (batch, seq, vocab)


def next_token_loss(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the vocabulary for (batch, seq, vocab) logits and (batch, seq) targets."""
    return F.cross_entropy(logits.flatten(0, 1), target_ids.flatten())


class SuccessorChainBatches:
    def __init__(self, config: GPTConfig, seed: int):
        self.config = config
        self.seed = seed
        self.successor = torch.randperm(config.vocab_size, generator=batch_generator(seed, FIXED_DATA_STEP))

    def __call__(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        config = self.config
        generator = batch_generator(self.seed, step)
        shape = (config.batch_size, config.seq_length + 1)
        random_tokens = torch.randint(config.vocab_size, shape, generator=generator)
        follows_pattern = torch.rand(shape, generator=generator) >= config.noise
        sequence = random_tokens.clone()
        for position in range(1, config.seq_length + 1):
            successor = self.successor[sequence[:, position - 1]]
            sequence[:, position] = torch.where(follows_pattern[:, position], successor, random_tokens[:, position])
        return (sequence[:, :-1].contiguous(),), sequence[:, 1:].contiguous()


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    make_batch = SuccessorChainBatches(config, seed)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="gpt",
        model=GPTLanguageModel(config),
        example_inputs=example_inputs,
        loss_fn=next_token_loss,
        make_batch=make_batch,
        num_classes=config.vocab_size,
    )
