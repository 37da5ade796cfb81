"""torch.profiler over a window of training steps (``metrics.profile_steps``).

Step records say how long each phase took; a profile says which operators and kernels
took it. Every rank records the steps of the window, from the start of the first one's
issue to the end of the last one's record, and then writes into ``<run dir>/profile``:

- ``rank-<r>.trace.json``: the Chrome trace (chrome://tracing, or https://ui.perfetto.dev),
  host operators and, on CUDA, the kernels on each stream;
- ``rank-<r>.txt``: the operators and kernels that took the most time over the window,
  by their own device time on CUDA (by host time on the CPU), with the window's steps.

The trainer issues the window's first step only once the step before it is recorded, and
no step past the window's last before that one is recorded, so the trace holds the
window's steps and nothing of their neighbours (an evaluation or a checkpoint due inside
the window is in it too). A guard rollback inside the window ends the profile there: the
steps trained again are not profiled. Profiled steps run slower (the profiler records
every operator): their records carry ``profiled``, and the doctor leaves them out of its
steady steps; writing the profile is counted in no step's time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

TABLE_ROWS = 40
"""Rows of the table: the operators and kernels that took the most time."""


class StepProfiler:
    """Profiles steps ``first`` to ``last`` (inclusive) once: a step trained again after a
    rollback is not profiled a second time."""

    def __init__(self, first: int, last: int, folder: Path, rank: int, device: torch.device,
                 report: Callable[[str], None] = log.info) -> None:
        self.first, self.last = first, last
        self.folder, self.rank, self.device = folder, rank, device
        self.report = report
        self._profile: profile | None = None
        self._recorded: int | None = None  # the window's last step recorded so far
        self._done = False

    def covers(self, step: int) -> bool:
        """Whether ``step`` runs under the profiler (its record is marked ``profiled``)."""
        return self._profile is not None and self.first <= step <= self.last

    def starts_after(self, step: int) -> bool:
        """Whether the window's first step follows ``step``: it waits for ``step``'s record,
        so that the trace starts with it (and the profiler's start is counted in its time)."""
        return not self._done and self._profile is None and step + 1 == self.first

    def ends_at(self, step: int) -> bool:
        """Whether ``step`` is the window's last while it is being profiled: the next step
        waits for its record, so that the trace ends with it."""
        return self._profile is not None and step == self.last

    def resumed_at(self, step: int) -> None:
        """The run starts after ``step`` (0: a fresh start): a window whose first step is
        behind it is not profiled, and rank 0 says so."""
        if step >= self.first and not self._done:
            self._done = True
            if self.rank == 0:
                self.report(f"metrics.profile_steps = [{self.first}, {self.last}]: the run resumed after step {step}, "
                            f"past the window's first step, so nothing is profiled; give a later window to profile "
                            f"this run")

    def step_issued(self, step: int) -> None:
        """Called as ``step`` starts: the window's first starts the profiler."""
        if step == self.first and self._profile is None and not self._done:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._profile = profile(activities=activities)
            self._profile.start()

    def step_recorded(self, step: int) -> bool:
        """Called after ``step``'s record is written: the window's last stops the profiler
        and writes the profile. Returns whether it did (that took time of no step's)."""
        if self._profile is None:
            return False
        self._recorded = step
        if step < self.last:
            return False
        self._finish(None)
        return True

    def rolled_back(self) -> None:
        """The guard rolled back inside the window: what was profiled is written, and the
        steps trained again are not profiled (nor are their records marked)."""
        if self._profile is not None:
            self._finish("then rolled back")

    def close(self) -> None:
        """The run ends (or fails) inside the window: what was profiled is written all the same."""
        if self._profile is not None:
            self._finish("the run ended")

    def _finish(self, cut_short: str | None) -> None:
        prof, self._profile, self._done = self._profile, None, True
        assert prof is not None
        recorded = (f"step {self.first}" if self._recorded in (None, self.first)
                    else f"steps {self.first}-{self._recorded}")
        steps = recorded if cut_short is None else f"{recorded} ({cut_short} before step {self.last})"
        try:
            prof.stop()
            self._write(prof, steps)
        except Exception as exc:  # a profile is never worth a run (nor the error that ended it)
            log.warning("metrics.profile_steps: the profile of %s was not written: %s", steps, exc)

    def _write(self, prof: profile, steps: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank-{self.rank}.trace.json"
        table = self.folder / f"rank-{self.rank}.txt"
        prof.export_chrome_trace(str(trace))
        cuda = self.device.type == "cuda"
        sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        heading = (f"rank {self.rank}, {steps}, on {self.device}: operators and kernels by their own "
                   f"{'device' if cuda else 'host'} time (torch.profiler)\n")
        table.write_text(heading + prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        if self.rank == 0:
            self.report(f"profile of {steps}: {table} and {trace.name} (Chrome trace) beside it, one per rank")


class NullProfiler:
    """No window: nothing is profiled."""

    def covers(self, step: int) -> bool:
        return False

    def starts_after(self, step: int) -> bool:
        return False

    def ends_at(self, step: int) -> bool:
        return False

    def resumed_at(self, step: int) -> None:
        pass

    def step_issued(self, step: int) -> None:
        pass

    def step_recorded(self, step: int) -> bool:
        return False

    def rolled_back(self) -> None:
        pass

    def close(self) -> None:
        pass
