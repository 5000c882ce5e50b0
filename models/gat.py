"""Two-layer GAT (Velickovic et al.) on the synthetic citation graph.

The edge softmax is computed with scatter ops: LeakyReLU edge scores, minus the
per-target maximum (``scatter_reduce`` "amax"), exp, and an ``index_add``
denominator. The edge index lives in buffers; the only input is the features.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import ZooTask
from .graphs import IGNORE_INDEX, CitationGraph, FullGraphBatches, synthetic_citation_graph


@dataclass(frozen=True)
class GATConfig:
    hidden_features: int  # per head
    num_heads: int
    dropout: float


CONFIGS = {
    "small": GATConfig(hidden_features=8, num_heads=2, dropout=0.3),
    "full": GATConfig(hidden_features=8, num_heads=8, dropout=0.6),
}


class GraphAttention(nn.Module):
    """Multi-head graph attention; heads are concatenated or averaged."""

    def __init__(self, in_features: int, out_features: int, num_heads: int, concat_heads: bool, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.out_features = out_features
        self.concat_heads = concat_heads
        self.linear = nn.Linear(in_features, num_heads * out_features, bias=False)
        self.source_attention = nn.Parameter(torch.empty(num_heads, out_features))
        self.target_attention = nn.Parameter(torch.empty(num_heads, out_features))
        nn.init.xavier_uniform_(self.source_attention)
        nn.init.xavier_uniform_(self.target_attention)
        self.leaky_relu = nn.LeakyReLU(0.2)
        self.attention_dropout = nn.Dropout(dropout)
        self.bias = nn.Parameter(torch.zeros(num_heads * out_features if concat_heads else out_features))

    def forward(self, x: torch.Tensor, edge_source: torch.Tensor, edge_target: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).unflatten(-1, (self.num_heads, self.out_features))  # (N, heads, F)
        source_scores = (h * self.source_attention).sum(dim=-1)  # (N, heads)
        target_scores = (h * self.target_attention).sum(dim=-1)
        edge_scores = self.leaky_relu(source_scores[edge_source] + target_scores[edge_target])  # (E, heads)

        # Softmax over the incoming edges of each target node.
        target_per_head = edge_target.unsqueeze(1).expand_as(edge_scores)
        max_per_target = edge_scores.new_zeros(target_scores.shape).scatter_reduce(
            0, target_per_head, edge_scores, reduce="amax", include_self=False
        )
        exp_scores = torch.exp(edge_scores - max_per_target.detach()[edge_target])
        denominators = exp_scores.new_zeros(target_scores.shape).index_add(0, edge_target, exp_scores)
        attention = self.attention_dropout(exp_scores / denominators[edge_target])

        messages = h[edge_source] * attention.unsqueeze(-1)  # (E, heads, F)
        aggregated = messages.new_zeros(h.shape).index_add(0, edge_target, messages)
        combined = aggregated.flatten(1) if self.concat_heads else aggregated.mean(dim=1)
        return combined + self.bias


class GAT(nn.Module):
    def __init__(self, graph: CitationGraph, hidden_features: int, num_heads: int, dropout: float):
        super().__init__()
        self.register_buffer("edge_source", graph.edge_index[0].clone())
        self.register_buffer("edge_target", graph.edge_index[1].clone())
        self.input_dropout = nn.Dropout(dropout)
        self.attention1 = GraphAttention(graph.features.size(1), hidden_features, num_heads, True, dropout)
        self.elu = nn.ELU()
        self.hidden_dropout = nn.Dropout(dropout)
        self.attention2 = GraphAttention(hidden_features * num_heads, graph.num_classes, 1, False, dropout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.input_dropout(features)
        x = self.elu(self.attention1(x, self.edge_source, self.edge_target))
        x = self.hidden_dropout(x)
        return self.attention2(x, self.edge_source, self.edge_target)


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    graph = synthetic_citation_graph(size, seed)
    make_batch = FullGraphBatches(graph)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="gat",
        model=GAT(graph, config.hidden_features, config.num_heads, config.dropout),
        example_inputs=example_inputs,
        loss_fn=nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX),
        make_batch=make_batch,
        num_classes=graph.num_classes,
    )
