"""What every pass returns: the graph it produced and whether it changed anything, with counts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassResult:
    graph_module: Any
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)
