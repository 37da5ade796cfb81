"""Idle and waste: how much of a run's paid time went to an idle GPU, data-loading stalls
and exposed communication.

Paid time is the sum of the step times of the records judged; each waste is a share of it,
and money too where every record carries its cost (``cost_per_step_usd``, with a price:
a step's cost is proportional to its time, so the share of the time is the share of the
cost). The doctor reports all three over a run's steady steps; the live progress
(``WasteWatch``) flags those above their thresholds over the last ``metrics.waste_window``
steps. The thresholds are ``[metrics]`` fields, read only here and by the doctor's verdicts.

- **idle GPU**: spans of at least ``metrics.idle_span_steps`` consecutive steps whose GPU
  utilisation is below ``metrics.idle_gpu_util``; the time of those spans. NVML is read
  only on the steps that log (``metrics.log_every``), so a reading stands for the steps up
  to the next one. Runs without readings (CPU) have no such figure.
- **data stall**: time waiting for the steps' micro-batches.
- **exposed communication**: communication the computation did not hide (``comm_s``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

from meshyard.config.sections import MetricsConfig
from meshyard.metrics.schema import phase_key

IDLE_GPU = "idle GPU"
DATA_STALL = "data stall"
EXPOSED_COMM = "exposed comm"


@dataclass(frozen=True)
class Waste:
    """One kind of waste over ``steps`` records: ``wasted_s`` of ``paid_s`` seconds of step
    time (``wasted_usd`` with a cost per step), and whether it crossed its threshold."""

    kind: str
    wasted_s: float
    paid_s: float
    steps: int
    flagged: bool
    wasted_usd: float | None = None

    @property
    def fraction(self) -> float:
        return self.wasted_s / self.paid_s if self.paid_s > 0 else 0.0

    def flag(self) -> str:
        """The short text of the live progress: 'idle GPU 42% of last 50 steps'."""
        return f"{self.kind} {100 * self.fraction:.0f}% of last {self.steps} steps"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction}


def find_waste(records: Sequence[dict[str, Any]], cfg: MetricsConfig) -> list[Waste]:
    """Every waste measured in ``records`` (idle GPU, data stall, exposed communication),
    in that order; a kind the records do not measure is left out."""
    if not records:
        return []
    paid = sum(r["step_time_s"] for r in records)
    cost = _cost(records)
    found = [
        _waste(IDLE_GPU, idle_seconds(records, cfg.idle_gpu_util, cfg.idle_span_steps), paid, records, cost,
               lambda wasted: wasted > 0),
        _waste(DATA_STALL, _phase_seconds(records, "data"), paid, records, cost,
               lambda wasted: wasted >= cfg.data_stall_share * paid),
        _waste(EXPOSED_COMM, _phase_seconds(records, "comm"), paid, records, cost,
               lambda wasted: wasted >= cfg.exposed_comm_share * paid),
    ]
    return [waste for waste in found if waste is not None]


def _waste(kind: str, wasted: float | None, paid: float, records: Sequence[dict[str, Any]], cost: float | None,
           over: Callable[[float], bool]) -> Waste | None:
    if wasted is None:
        return None
    usd = cost * wasted / paid if cost is not None and paid > 0 else None
    return Waste(kind, wasted, paid, len(records), bool(over(wasted)), usd)


def idle_seconds(records: Sequence[dict[str, Any]], threshold: float, span_steps: int) -> float | None:
    """Step time spent in idle spans: at least ``span_steps`` consecutive steps whose GPU
    utilisation (the latest reading, 0-1) is below ``threshold``. None without readings."""
    if not any("gpu_utilization_pct" in r for r in records):
        return None
    idle_total, span, reading = 0.0, [], None
    for record in records:
        reading = record.get("gpu_utilization_pct", reading)
        if reading is not None and reading / 100 < threshold:
            span.append(record["step_time_s"])
            continue
        idle_total += sum(span) if len(span) >= span_steps else 0.0
        span = []
    return idle_total + (sum(span) if len(span) >= span_steps else 0.0)


def _phase_seconds(records: Iterable[dict[str, Any]], phase: str) -> float | None:
    """Seconds of one phase of the step breakdown; None when the run was not broken down
    (waiting for data is also recorded without it, as ``data_time_s``)."""
    key = phase_key(phase)
    records = list(records)
    if phase == "data":
        return sum(r[key] if key in r else r["data_time_s"] for r in records)
    if not all(key in r for r in records):
        return None
    return sum(r[key] for r in records)


def _cost(records: Sequence[dict[str, Any]]) -> float | None:
    if not all("cost_per_step_usd" in r for r in records):
        return None
    return sum(r["cost_per_step_usd"] for r in records)


class WasteWatch:
    """The last ``metrics.waste_window`` step records, and the flags of the waste above its
    threshold among them, for the live progress."""

    def __init__(self, cfg: MetricsConfig) -> None:
        self.cfg = cfg
        self.recent: deque[dict[str, Any]] = deque(maxlen=cfg.waste_window)

    def add(self, record: dict[str, Any]) -> None:
        self.recent.append(record)

    def flags(self) -> list[str]:
        return [waste.flag() for waste in find_waste(list(self.recent), self.cfg) if waste.flagged]
