"""Everything measured about a step besides loss and learning rate, in one place.

The Trainer calls ``start_step`` and ``close_step`` around the work it issues for a step
and ``finish_step`` once the step's figures are back on the host (on a GPU usually one
step later); the meter turns that into the record's figures: the time breakdown,
throughput and MFU, memory, and (every few steps) every rank's figures with stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshyard.metrics.memory import MemoryProbe
from meshyard.metrics.ranks import RankWindow
from meshyard.metrics.schema import OTHER_KEY, PHASE_KEYS
from meshyard.metrics.timing import NullStepTimer, PhaseTimes, StepTimer


@dataclass(frozen=True)
class StepReadings:
    """What is taken of a step when its work has been issued: its phase times (on GPU still
    events to read) and the memory figures, which the allocator knows on the host at once."""

    phases: PhaseTimes
    memory: dict[str, Any]


class StepMeter:
    def __init__(self, timer: StepTimer | NullStepTimer, memory: MemoryProbe, window: RankWindow | None,
                 flops_per_token: float | None, peak_flops: float | None, world_size: int) -> None:
        self.timer = timer
        self.memory = memory
        self.window = window
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # per rank
        self.world_size = world_size

    def start_step(self) -> None:
        self.timer.start_step()

    def close_step(self) -> StepReadings:
        """Readings of the step whose work was just issued (no wait for the device)."""
        return StepReadings(self.timer.close_step(), self.memory.read())

    def finish_step(self, step_time: float, tokens: int, readings: StepReadings | None = None,
                    runner_figures: dict[str, Any] | None = None) -> dict[str, Any]:
        """Figures of a completed step from its ``readings`` (by default those of the step
        just issued); ``runner_figures`` (a pipeline stage's idle share) join the per-rank
        window only."""
        readings = readings or self.close_step()
        figures: dict[str, Any] = readings.phases.seconds()
        if figures:
            # Whatever the phases do not cover (logging, checkpoint bookkeeping, Python).
            figures[OTHER_KEY] = max(0.0, step_time - sum(figures[key] for key in PHASE_KEYS))
            figures["busy_s"] = step_time - figures["comm_s"]
        figures.update(readings.memory)
        if self.flops_per_token and self.peak_flops:
            achieved = self.flops_per_token * tokens / step_time
            figures["model_tflops"] = achieved / 1e12
            figures["mfu"] = achieved / (self.peak_flops * self.world_size)
        if self.window is not None:
            self.window.add({**(runner_figures or {}), **figures, "step_time_s": step_time,
                             "memory_bytes": _memory_of(figures)})
        return figures

    def gather_due(self, step: int) -> bool:
        return self.window is not None and self.window.due(step)

    def gather(self) -> dict[str, Any] | None:
        assert self.window is not None
        return self.window.gather()


def _memory_of(figures: dict[str, Any]) -> float:
    return float(figures.get("gpu_peak_reserved_bytes", figures.get("rss_bytes", 0)))

