"""BERT-style encoder classifying synthetic token sequences.

Label 1 means the sequence contains the marker token (the last vocabulary id)
somewhere; label 0 means it does not. The encoder is post-LayerNorm like BERT
and mean-pools the final hidden states into a linear head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import ZooTask, batch_generator
from .transformer import TokenAndPositionEmbedding, TransformerBlock


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    seq_length: int
    dim: int
    num_heads: int
    num_layers: int
    feed_forward_dim: int
    batch_size: int
    num_classes: int = 2
    dropout: float = 0.1


CONFIGS = {
    "small": BertConfig(vocab_size=32, seq_length=16, dim=32, num_heads=2, num_layers=2, feed_forward_dim=64, batch_size=16),
    "full": BertConfig(vocab_size=1024, seq_length=64, dim=128, num_heads=4, num_layers=4, feed_forward_dim=512, batch_size=32),
}


class BertClassifier(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.embedding = TokenAndPositionEmbedding(config.vocab_size, config.seq_length, config.dim)
        self.embedding_norm = nn.LayerNorm(config.dim)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(config.dim, config.num_heads, config.feed_forward_dim, config.dropout, norm_first=False)
            for _ in range(config.num_layers)
        )
        self.head = nn.Linear(config.dim, config.num_classes)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding_dropout(self.embedding_norm(self.embedding(token_ids)))
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden.mean(dim=1))


class MarkerTokenBatches:
    def __init__(self, config: BertConfig, seed: int):
        self.config = config
        self.seed = seed
        self.marker_token = config.vocab_size - 1

    def __call__(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        config = self.config
        generator = batch_generator(self.seed, step)
        shape = (config.batch_size, config.seq_length)
        token_ids = torch.randint(self.marker_token, shape, generator=generator)  # never the marker
        labels = torch.randint(2, (config.batch_size,), generator=generator)
        marker_positions = torch.randint(config.seq_length, (config.batch_size,), generator=generator)
        with_marker = labels.bool()
        token_ids[with_marker, marker_positions[with_marker]] = self.marker_token
        return (token_ids,), labels


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    make_batch = MarkerTokenBatches(config, seed)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="bert",
        model=BertClassifier(config),
        example_inputs=example_inputs,
        loss_fn=nn.CrossEntropyLoss(),
        make_batch=make_batch,
        num_classes=config.num_classes,
    )
