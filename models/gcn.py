"""Two-layer GCN (Kipf & Welling) on the synthetic citation graph.

Message passing uses gather + ``index_add`` over an edge index held in buffers
(no ``torch.sparse``, which lacks fp16 CPU kernels); the model's only input is
the node feature matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import ZooTask
from .graphs import IGNORE_INDEX, CitationGraph, FullGraphBatches, synthetic_citation_graph


@dataclass(frozen=True)
class GCNConfig:
    hidden_features: int
    dropout: float


CONFIGS = {
    "small": GCNConfig(hidden_features=16, dropout=0.5),
    "full": GCNConfig(hidden_features=64, dropout=0.5),
}


def symmetric_edge_norm(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``1 / sqrt(deg(src) * deg(dst))`` per edge (degrees include self loops)."""
    source, target = edge_index
    inv_sqrt_degree = torch.bincount(target, minlength=num_nodes).float().pow(-0.5)
    return inv_sqrt_degree[source] * inv_sqrt_degree[target]


class GraphConvolution(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(
        self, x: torch.Tensor, edge_source: torch.Tensor, edge_target: torch.Tensor, edge_norm: torch.Tensor
    ) -> torch.Tensor:
        h = self.linear(x)
        messages = h[edge_source] * edge_norm.unsqueeze(1)
        aggregated = messages.new_zeros(h.shape).index_add(0, edge_target, messages)
        return aggregated + self.bias


class GCN(nn.Module):
    def __init__(self, graph: CitationGraph, hidden_features: int, dropout: float):
        super().__init__()
        self.register_buffer("edge_source", graph.edge_index[0].clone())
        self.register_buffer("edge_target", graph.edge_index[1].clone())
        self.register_buffer("edge_norm", symmetric_edge_norm(graph.edge_index, graph.num_nodes))
        self.input_dropout = nn.Dropout(dropout)
        self.conv1 = GraphConvolution(graph.features.size(1), hidden_features)
        self.relu = nn.ReLU()
        self.hidden_dropout = nn.Dropout(dropout)
        self.conv2 = GraphConvolution(hidden_features, graph.num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.input_dropout(features)
        x = self.relu(self.conv1(x, self.edge_source, self.edge_target, self.edge_norm))
        x = self.hidden_dropout(x)
        return self.conv2(x, self.edge_source, self.edge_target, self.edge_norm)


def build_task(size: str, seed: int) -> ZooTask:
    config = CONFIGS[size]
    graph = synthetic_citation_graph(size, seed)
    make_batch = FullGraphBatches(graph)
    example_inputs, _ = make_batch(0)
    return ZooTask(
        name="gcn",
        model=GCN(graph, config.hidden_features, config.dropout),
        example_inputs=example_inputs,
        loss_fn=nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX),
        make_batch=make_batch,
        num_classes=graph.num_classes,
    )
