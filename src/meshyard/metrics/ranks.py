"""Per-rank figures gathered to rank 0 every few steps, and straggler detection.

Every rank averages its own figures over a window of steps; at the window's end one
small all-gather brings them to rank 0 (cheap: one collective per window, not per step).

Step times are equalised by synchronisation (a slow rank makes the others wait in the
gradient all-reduce), so stragglers are found by *busy* time: step time minus the time
spent waiting for communication. A rank whose busy time exceeds the median by
``factor`` is named.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from meshyard.metrics.schema import RANK_FIELDS


def find_stragglers(busy: list[float], factor: float) -> list[int]:
    """Ranks whose busy time is above ``factor`` x the median of all ranks."""
    if len(busy) < 2:
        return []
    median = statistics.median(busy)
    return [rank for rank, value in enumerate(busy) if median > 0 and value > factor * median]


class RankWindow:
    """Accumulates this rank's figures and gathers everyone's every ``every`` steps."""

    def __init__(self, every: int, straggler_factor: float) -> None:
        self.every = every
        self.factor = straggler_factor
        self._sums = dict.fromkeys(RANK_FIELDS, 0.0)
        self._count = 0

    def add(self, figures: dict[str, Any]) -> None:
        for field in RANK_FIELDS:
            self._sums[field] += float(figures.get(field, 0.0))
        self._count += 1

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and self._count > 0

    def gather(self) -> dict[str, Any] | None:
        """Collective: every rank calls it at the same step. Rank 0 gets
        ``{"ranks": {field: [per-rank mean]}, "stragglers": [...]}``; the others None."""
        local = torch.tensor([self._sums[f] / self._count for f in RANK_FIELDS], dtype=torch.float64)
        table = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(table, local)
        self._sums = dict.fromkeys(RANK_FIELDS, 0.0)
        self._count = 0
        if dist.get_rank() != 0:
            return None
        per_field = {f: [row[i].item() for row in table] for i, f in enumerate(RANK_FIELDS)}
        return {"ranks": per_field, "stragglers": find_stragglers(per_field["busy_s"], self.factor)}
