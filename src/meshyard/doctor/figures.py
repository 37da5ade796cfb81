"""Which figures describe a run, and from which record keys: the report's and the dashboard's.

A figure is a title, a unit and its series, each series a key of the step record
(``metrics.schema``) times a scale. The live dashboard draws every figure here, its
Prometheus mode queries each series' gauge, and the Grafana dashboard is built from the
same list, so the three cannot disagree about what a figure shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from meshyard.metrics.schema import OTHER, OTHER_KEY, PHASES, phase_key

MIB = 2.0**-20
MS = 1000.0


@dataclass(frozen=True)
class Series:
    """One line of a figure: record key ``key`` times ``scale``, named ``label``."""

    key: str
    label: str
    scale: float = 1.0


@dataclass(frozen=True)
class Figure:
    """One chart; ``stacked``: its series add up (the step-time breakdown)."""

    name: str
    title: str
    unit: str
    series: tuple[Series, ...]
    stacked: bool = False


# In the order a reader looks for them: is it learning, how fast, where the time goes,
# what it holds, what it costs.
FIGURES: tuple[Figure, ...] = (
    Figure("loss", "Loss", "nats", (Series("loss", "train"), Series("eval_loss", "eval"))),
    Figure("throughput", "Throughput", "tokens/s", (Series("tokens_per_s", "tokens/s (all ranks)"),)),
    Figure("mfu", "Model FLOPs utilisation", "%", (Series("mfu", "MFU", 100.0),)),
    Figure("breakdown", "Step time breakdown", "ms",
           tuple(Series(phase_key(phase), phase, MS) for phase in (*PHASES, OTHER)), stacked=True),
    Figure("memory", "Memory (rank 0)", "MiB", (
        Series("gpu_peak_reserved_bytes", "GPU peak reserved", MIB),
        Series("gpu_peak_allocated_bytes", "GPU peak allocated", MIB),
        Series("rss_bytes", "resident (CPU)", MIB))),
    Figure("gpu_utilization", "GPU utilisation (rank 0)", "%", (Series("gpu_utilization_pct", "GPU busy"),)),
    Figure("cost", "Cost", "USD", (Series("cost_so_far_usd", "so far"),
                                   Series("cost_projected_usd", "projected to the last step"))),
)

# Record keys the headline figures read besides the series.
HEADLINE_KEYS: tuple[str, ...] = ("step", "time", "step_time_s", "guard", "checkpoint_step")
BREAKDOWN_KEYS: tuple[str, ...] = tuple(phase_key(phase) for phase in PHASES)


def figure_keys(figures: Sequence[Figure] = FIGURES) -> tuple[str, ...]:
    """Every record key ``figures`` and the headline read, once each, in order."""
    keys = [*HEADLINE_KEYS, *(series.key for figure in figures for series in figure.series)]
    return tuple(dict.fromkeys(keys))


FIGURE_KEYS = figure_keys()


def slim(record: dict[str, Any]) -> dict[str, Any]:
    """A record cut to the keys the figures read (records also carry per-rank windows and
    lists that a page polling every second need not receive)."""
    return {key: record[key] for key in FIGURE_KEYS if key in record}


def memory_key(records: Sequence[dict[str, Any]]) -> str:
    """The memory figure of a run when one line is drawn: the GPU allocator's peak reserved
    bytes on a GPU run, else the resident set."""
    key = "gpu_peak_reserved_bytes"
    return key if any(key in record for record in records) else "rss_bytes"


def with_other(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the time its phases leave uncovered, where it has the phases but not
    that remainder (a record rebuilt from Prometheus, which does not export it)."""
    if OTHER_KEY in record or "step_time_s" not in record or not all(key in record for key in BREAKDOWN_KEYS):
        return record
    return {**record, OTHER_KEY: max(0.0, record["step_time_s"] - sum(record[key] for key in BREAKDOWN_KEYS))}


def as_json(figures: Sequence[Figure] = FIGURES) -> list[dict[str, Any]]:
    """The figures as the page's script reads them."""
    return [asdict(figure) for figure in figures]
