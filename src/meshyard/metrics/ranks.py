"""Per-rank figures gathered to rank 0 every few steps, and straggler detection.

Every rank averages its own figures over a window of steps; at the window's end one
small all-gather brings them to rank 0 (cheap: one collective per window, not per step).

Step times are equalised by synchronisation (a slow rank makes the others wait in the
gradient all-reduce), so stragglers are found by *busy* time: step time minus the time
spent waiting for communication. A rank whose busy time exceeds the median by
``factor`` is named, with its host (``runtime/hosts.py``: hosts of one job may share a
hostname, so a host is named by its hostname and the address that reaches the master).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshyard.metrics.schema import RANK_FIELDS
from meshyard.runtime.hosts import host_of


def find_stragglers(busy: list[float], factor: float) -> list[int]:
    """Ranks whose busy time is above ``factor`` x the median of all ranks."""
    if len(busy) < 2:
        return []
    median = statistics.median(busy)
    return [rank for rank, value in enumerate(busy) if median > 0 and value > factor * median]


class RankWindow:
    """Accumulates this rank's figures and gathers everyone's every ``every`` steps.

    ``hosts``: every rank's host label, indexed by rank (``gather_host_labels``), to name
    the stragglers' hosts; empty when they were not gathered."""

    def __init__(self, every: int, straggler_factor: float, hosts: Sequence[str] = ()) -> None:
        self.every = every
        self.factor = straggler_factor
        self.hosts = list(hosts)
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
        ``{"ranks": {field: [per-rank mean]}, "stragglers": [rank, ...], "straggler_hosts":
        [host, ...]}`` (the hosts only when known); the others None."""
        local = torch.tensor([self._sums[f] / self._count for f in RANK_FIELDS], dtype=torch.float64)
        table = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(table, local)
        self._sums = dict.fromkeys(RANK_FIELDS, 0.0)
        self._count = 0
        if dist.get_rank() != 0:
            return None
        per_field = {f: [row[i].item() for row in table] for i, f in enumerate(RANK_FIELDS)}
        stragglers = find_stragglers(per_field["busy_s"], self.factor)
        gathered: dict[str, Any] = {"ranks": per_field, "stragglers": stragglers}
        if self.hosts:
            gathered["straggler_hosts"] = [host_of(self.hosts, rank) for rank in stragglers]
        return gathered
