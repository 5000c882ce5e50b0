"""Synthetic citation graph (Cora-like) built with a networkx stochastic block model.

Nodes are papers in planted classes: citations are dense within a class and
sparse across classes, and each class has "topic words" that appear in its
bag-of-words features more often than background words.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

from . import FIXED_DATA_STEP, batch_generator

IGNORE_INDEX = -100  # target value for nodes outside the training set


@dataclass(frozen=True)
class CitationGraphConfig:
    class_sizes: tuple[int, ...]
    num_features: int
    mean_within_class_degree: float
    mean_cross_class_degree: float
    background_word_prob: float
    topic_word_prob: float
    train_nodes_per_class: int


CONFIGS = {
    # Cora: 2708 papers, 7 classes, 1433 words, ~3.9 citations per paper, ~18 words per paper.
    "full": CitationGraphConfig(
        class_sizes=(818, 426, 418, 351, 298, 217, 180),
        num_features=1433,
        mean_within_class_degree=3.1,
        mean_cross_class_degree=0.8,
        background_word_prob=0.008,
        topic_word_prob=0.03,
        train_nodes_per_class=20,
    ),
    "small": CitationGraphConfig(
        class_sizes=(40, 22, 22, 18, 16, 12, 10),
        num_features=64,
        mean_within_class_degree=3.1,
        mean_cross_class_degree=0.8,
        background_word_prob=0.05,
        topic_word_prob=0.3,
        train_nodes_per_class=5,
    ),
}


@dataclass
class CitationGraph:
    edge_index: torch.Tensor  # (2, E) int64; row 0 = source, row 1 = target; both directions + self loops
    features: torch.Tensor  # (N, F) float32, binary bag of words
    labels: torch.Tensor  # (N,) int64
    train_mask: torch.Tensor  # (N,) bool
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return self.labels.numel()

    def training_targets(self) -> torch.Tensor:
        """Labels with ``IGNORE_INDEX`` on nodes outside the training set."""
        return self.labels.masked_fill(~self.train_mask, IGNORE_INDEX)


def synthetic_citation_graph(size: str = "small", seed: int = 0) -> CitationGraph:
    config = CONFIGS[size]
    num_classes = len(config.class_sizes)
    num_nodes = sum(config.class_sizes)
    # Edge probabilities that give the configured mean degrees over all nodes.
    within_pairs_per_node = sum(n * (n - 1) for n in config.class_sizes) / num_nodes
    cross_pairs_per_node = sum(n * (num_nodes - n) for n in config.class_sizes) / num_nodes
    within_prob = config.mean_within_class_degree / within_pairs_per_node
    cross_prob = config.mean_cross_class_degree / cross_pairs_per_node
    block_probs = [[within_prob if i == j else cross_prob for j in range(num_classes)] for i in range(num_classes)]
    graph = nx.stochastic_block_model(list(config.class_sizes), block_probs, seed=seed, sparse=True)

    generator = batch_generator(seed, FIXED_DATA_STEP)
    # Shuffle node ids so labels are not sorted by class.
    new_id = torch.randperm(num_nodes, generator=generator)
    block_labels = torch.tensor([graph.nodes[node]["block"] for node in range(num_nodes)])
    labels = torch.empty(num_nodes, dtype=torch.long)
    labels[new_id] = block_labels

    citations = torch.tensor(list(graph.edges()), dtype=torch.long).reshape(-1, 2).T
    citations = new_id[citations]
    self_loops = torch.arange(num_nodes).expand(2, num_nodes)
    edge_index = torch.cat([citations, citations.flip(0), self_loops], dim=1)

    word_topic = torch.randint(num_classes, (config.num_features,), generator=generator)
    is_topic_word = word_topic[None, :] == labels[:, None]  # (N, F)
    word_probs = torch.where(is_topic_word, config.topic_word_prob, config.background_word_prob)
    features = (torch.rand(num_nodes, config.num_features, generator=generator) < word_probs).float()

    train_mask = torch.zeros(num_nodes, dtype=torch.bool)
    for label in range(num_classes):
        class_nodes = (labels == label).nonzero().squeeze(1)
        chosen = torch.randperm(class_nodes.numel(), generator=generator)[: config.train_nodes_per_class]
        train_mask[class_nodes[chosen]] = True

    return CitationGraph(edge_index, features, labels, train_mask, num_classes)


class FullGraphBatches:
    """Full-batch node classification: every step sees the whole graph."""

    def __init__(self, graph: CitationGraph):
        self.features = graph.features
        self.targets = graph.training_targets()

    def __call__(self, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return (self.features.clone(),), self.targets.clone()
