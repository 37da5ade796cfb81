"""What training costs: the price of a device-hour and the arithmetic of every cost meshyard shows.

A run pays for its devices while they work: a device-hour is one device (a GPU, or a CPU
rank) for one hour, so a step costs ``price / 3600 x world size x step time``. The
progress line, metrics.jsonl, summary.json, Prometheus, the HTML report and
``meshyard plan`` all take their figures from the functions here, in US dollars.

Spot (preemptible) capacity is cheaper per hour but gets taken away: each restart costs
the time to resume (from the last recorded step to the checkpoint loaded again, as
restarts.jsonl records it) plus the steps lost since the last checkpoint, done again.
What spot capacity would have cost is the spot price over the paid time plus that
overhead.

It imports nothing but the standard library, like the catalog it is keyed by
(``meshyard.hardware``): the planner and the doctor read it without torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

SECONDS_PER_HOUR = 3600.0

RECENT_STEPS = 10
"""Steps whose mean cost projects the cost of the steps still to run."""


@dataclass(frozen=True)
class DevicePrice:
    """What one device of a model costs per hour, in US dollars."""

    on_demand: float
    spot: float
    """Preemptible capacity of the same model; 0 where none is sold."""


# Examples to edit, not quotes: typical public cloud list prices per GPU-hour (USD) of the
# catalog's models, on demand and spot. Contracts differ by far more than models do: put
# your own figures here, or set run.gpu_hour_price / run.spot_hour_price for one run and
# --gpu-hour-price / --spot-hour-price for 'meshyard plan'.
PRICES: dict[str, DevicePrice] = {
    "h200": DevicePrice(on_demand=3.80, spot=1.90),
    "h100": DevicePrice(on_demand=3.00, spot=1.50),
    "h100-pcie": DevicePrice(on_demand=2.50, spot=1.25),
    "a100": DevicePrice(on_demand=1.80, spot=0.90),
    "a100-40gb": DevicePrice(on_demand=1.30, spot=0.65),
    "l40s": DevicePrice(on_demand=1.00, spot=0.50),
    "l4": DevicePrice(on_demand=0.80, spot=0.30),
}


@dataclass(frozen=True)
class Price:
    """The price a run or a plan is costed at, and where it came from."""

    per_hour: float
    """US dollars per device-hour, on demand (always above 0)."""
    spot_per_hour: float = 0.0
    """US dollars per preemptible device-hour; 0 when unknown (no spot estimate)."""
    source: str = ""

    def facts(self) -> dict[str, Any]:
        """The price as run.json records it."""
        return {"gpu_hour_price": self.per_hour, "spot_hour_price": self.spot_per_hour, "price_source": self.source}

    @classmethod
    def from_facts(cls, facts: Mapping[str, Any]) -> "Price | None":
        """The price a run recorded in run.json (``facts``); None when it had none."""
        per_hour = facts.get("gpu_hour_price") or 0.0
        if per_hour <= 0:
            return None
        return cls(per_hour, facts.get("spot_hour_price") or 0.0, facts.get("price_source", ""))


def resolve_price(gpu_hour_price: float, spot_hour_price: float, device_model: str | None,
                  option: str = "run.gpu_hour_price", table: Mapping[str, DevicePrice] = PRICES) -> Price | None:
    """The price to cost at: ``gpu_hour_price`` when above 0 (named ``option`` in reports),
    else the table's on-demand price of ``device_model`` (a catalog name such as 'h100');
    the spot price likewise. None when neither gives an on-demand price: no cost is shown."""
    listed = table.get(device_model) if device_model else None
    per_hour = gpu_hour_price if gpu_hour_price > 0 else (listed.on_demand if listed else 0.0)
    if per_hour <= 0:
        return None
    spot = spot_hour_price if spot_hour_price > 0 else (listed.spot if listed else 0.0)
    source = option if gpu_hour_price > 0 else f"price table ({device_model})"
    return Price(per_hour, spot, source)


def device_time_cost(per_hour: float, devices: int, seconds: float) -> float:
    """What ``devices`` devices cost for ``seconds`` at ``per_hour`` each."""
    return per_hour / SECONDS_PER_HOUR * devices * seconds


def projected_cost(so_far: float, remaining_steps: int, recent: Iterable[float]) -> float:
    """Cost so far plus the remaining steps at the mean cost of the ``recent`` steps."""
    recent = list(recent)
    mean = sum(recent) / len(recent) if recent else 0.0
    return so_far + max(0, remaining_steps) * mean


class CostMeter:
    """The cost figures of each step's record: its cost, the run's so far, and the
    projection to the last step (``total_steps``)."""

    def __init__(self, price: Price, devices: int, total_steps: int, recent_steps: int = RECENT_STEPS) -> None:
        self.price = price
        self.devices = devices
        self.total_steps = total_steps
        self._recent: deque[float] = deque(maxlen=recent_steps)

    def step_figures(self, step: int, step_time_s: float, so_far_before: float) -> dict[str, float]:
        """Figures of step ``step`` that took ``step_time_s``, after ``so_far_before`` was
        spent on the steps before it (restored from a checkpoint after a resume)."""
        per_step = device_time_cost(self.price.per_hour, self.devices, step_time_s)
        self._recent.append(per_step)
        so_far = so_far_before + per_step
        return {"cost_per_step_usd": per_step, "cost_so_far_usd": so_far,
                "cost_projected_usd": projected_cost(so_far, self.total_steps - step, self._recent)}


class NullCostMeter:
    """No price: no cost figures."""

    price = None

    def step_figures(self, step: int, step_time_s: float, so_far_before: float) -> dict[str, float]:
        return {}


def restart_overhead_s(restarts: Iterable[Mapping[str, Any]], step_time_s: float) -> float:
    """Seconds the restarts of ``restarts`` (restarts.jsonl's entries) cost: each one's time
    to resume plus its lost steps done again at ``step_time_s``."""
    return sum((entry.get("resume_s") or 0.0) + (entry.get("steps_lost") or 0) * step_time_s for entry in restarts)


def cost_summary(price: Price, devices: int, cost_so_far: float, step_time_s: float,
                 restarts: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """What a run cost (``cost_so_far`` over its recorded steps of mean ``step_time_s``), and
    with its measured restart overhead what spot capacity would have cost (when the spot
    price is known), as summary.json and the report hold it."""
    device_hours = cost_so_far / price.per_hour
    overhead = restart_overhead_s(restarts, step_time_s)
    summary = {"gpu_hour_price": price.per_hour, "price_source": price.source, "device_hours": device_hours,
               "cost_usd": cost_so_far, "restart_overhead_s": overhead,
               "restart_cost_usd": device_time_cost(price.per_hour, devices, overhead)}
    if price.spot_per_hour > 0:
        summary["spot_hour_price"] = price.spot_per_hour
        summary["spot_cost_usd"] = spot_cost(price.spot_per_hour, devices, device_hours * SECONDS_PER_HOUR / devices,
                                             overhead)
    return summary


def spot_cost(spot_per_hour: float, devices: int, paid_s: float, overhead_s: float) -> float:
    """Spot price over the paid time and the restart overhead, on ``devices`` devices."""
    return device_time_cost(spot_per_hour, devices, paid_s + overhead_s)


def fmt_usd(amount: float) -> str:
    """'$1,234.56' from a dollar up; three significant digits below it, never in
    exponent notation ('$0.00123'), since a CPU step costs millionths."""
    if abs(amount) >= 1 or not amount:
        return f"${amount:,.2f}"
    decimals = 2 - math.floor(math.log10(abs(amount)))
    return f"${amount:.{decimals}f}"
