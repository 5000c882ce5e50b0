"""Transformer building blocks shared by the BERT- and GPT-style models.

Attention is written with plain tensor ops (no ``nn.MultiheadAttention``) and
without shape-dependent Python control flow, so ``torch.fx.symbolic_trace``
sees every matmul, scale, softmax and mask.
"""
from __future__ import annotations

import torch
from torch import nn


class TokenAndPositionEmbedding(nn.Module):
    def __init__(self, vocab_size: int, max_length: int, dim: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        self.register_buffer("position_ids", torch.arange(max_length), persistent=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # narrow (not slicing) so symbolic_trace can take the length from a Proxy
        position_ids = self.position_ids.narrow(0, 0, token_ids.size(1))
        return self.tokens(token_ids) + self.positions(position_ids)


class MultiHeadSelfAttention(nn.Module):
    """Scaled dot-product self-attention; ``causal_max_length`` enables a causal mask."""

    def __init__(self, dim: int, num_heads: int, dropout: float, causal_max_length: int | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.attention_dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dim, dim)
        self.causal = causal_max_length is not None
        if self.causal:
            lower_triangle = torch.tril(torch.ones(causal_max_length, causal_max_length, dtype=torch.bool))
            self.register_buffer("causal_mask", lower_triangle, persistent=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, dim) -> (batch, heads, seq, head_dim)
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.split_heads(self.query(x))
        key = self.split_heads(self.key(x))
        value = self.split_heads(self.value(x))
        scores = torch.matmul(query, key.transpose(-2, -1)) * self.scale
        if self.causal:
            seq_length = x.size(1)
            allowed = self.causal_mask.narrow(0, 0, seq_length).narrow(1, 0, seq_length)
            scores = scores.masked_fill(allowed.logical_not(), float("-inf"))
        weights = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(weights, value).transpose(1, 2).flatten(2)
        return self.out(context)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.expand = nn.Linear(dim, hidden_dim)
        self.activation = nn.GELU()
        self.contract = nn.Linear(hidden_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.contract(self.activation(self.expand(x))))


class TransformerBlock(nn.Module):
    """Attention + feed-forward with residuals; post-LayerNorm (BERT) or pre-LayerNorm (GPT)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        feed_forward_dim: int,
        dropout: float,
        norm_first: bool,
        causal_max_length: int | None = None,
    ):
        super().__init__()
        self.norm_first = norm_first
        self.attention = MultiHeadSelfAttention(dim, num_heads, dropout, causal_max_length)
        self.attention_residual_dropout = nn.Dropout(dropout)
        self.attention_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, feed_forward_dim, dropout)
        self.feed_forward_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            x = x + self.attention_residual_dropout(self.attention(self.attention_norm(x)))
            return x + self.feed_forward(self.feed_forward_norm(x))
        x = self.attention_norm(x + self.attention_residual_dropout(self.attention(x)))
        return self.feed_forward_norm(x + self.feed_forward(x))
