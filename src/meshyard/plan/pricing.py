"""What a planned layout costs to train a number of tokens, on demand and on spot capacity.

The price and the arithmetic are a run's (``meshyard.metrics.cost``): devices x hours x
price per device-hour. On spot capacity a layout also pays for restarts, at the rate and
the cost a measured run had them (its restarts.jsonl): each restart's time to resume and
its lost steps, done again at the layout's own step time, as often per hour of training
as that run restarted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshyard.metrics.cost import Price, device_time_cost, restart_overhead_s, spot_cost
from meshyard.metrics.records import read_metrics
from meshyard.run_dir import RunDir

DEFAULT_TOKENS = 1e9
"""Tokens a layout is costed for unless --tokens says otherwise."""


@dataclass(frozen=True)
class MeasuredRestarts:
    """The restarts of a measured run and the time its recorded steps took."""

    run_dir: Path
    restarts: tuple[dict[str, Any], ...]
    trained_s: float
    """Sum of the step times metrics.jsonl holds: the training the restarts interrupted."""

    @classmethod
    def read(cls, run_dir: Path) -> "MeasuredRestarts":
        paths = RunDir(run_dir)
        records = read_metrics(run_dir) if paths.metrics.exists() else []
        return cls(run_dir, tuple(paths.read_restarts()), sum(r["step_time_s"] for r in records))

    def overhead_s(self, train_s: float, step_time_s: float) -> float:
        """Restart overhead of ``train_s`` seconds of training at ``step_time_s`` per step:
        this run's restarts, each with its lost steps at ``step_time_s``, scaled from its
        training time to ``train_s``."""
        if not self.restarts or self.trained_s <= 0:
            return 0.0
        return restart_overhead_s(self.restarts, step_time_s) * train_s / self.trained_s


@dataclass(frozen=True)
class LayoutCost:
    """What training the tokens costs on one layout."""

    train_s: float
    """Wall time of the steps, without restarts."""
    cost_usd: float
    """On demand."""
    spot_usd: float | None = None
    """On spot capacity, restart overhead included; None without a spot price."""
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Pricing:
    """How ``meshyard plan`` prices its layouts: the price, the tokens to train, and the
    restarts measured on spot capacity (None: no run measured)."""

    price: Price
    tokens: float = DEFAULT_TOKENS
    measured: MeasuredRestarts | None = None

    def cost_of(self, tokens_per_second: float, step_time_s: float, devices: int) -> LayoutCost:
        """The cost of ``tokens`` at ``tokens_per_second`` on ``devices`` devices."""
        train_s = self.tokens / tokens_per_second
        cost = device_time_cost(self.price.per_hour, devices, train_s)
        if self.price.spot_per_hour <= 0:
            return LayoutCost(train_s, cost)
        overhead = self.measured.overhead_s(train_s, step_time_s) if self.measured else 0.0
        return LayoutCost(train_s, cost, spot_cost(self.price.spot_per_hour, devices, train_s, overhead), overhead)
