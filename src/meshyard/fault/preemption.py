"""Preemption: a signal on any rank becomes a checkpoint and a clean, recognisable exit.

The handler only records the signal; the training loop sees it at the next step
boundary, where all ranks agree (the flag rides on the step's existing all-reduce), save
together, and exit with ``EXIT_PREEMPTED``. Acting inside the handler would interrupt a
collective half-way on one rank and hang the others.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

from meshyard.run_dir import RunDir

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", which is what a preempted job should do


class Preempted(Exception):
    """Raised out of the training loop after the preemption checkpoint is committed."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None, signal_time: float | None = None) -> None:
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        self.signal_time = signal_time  # wall-clock time of the first signal on any rank
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (saving failed or is disabled)"
        if step < 0:  # this node's workers saved with the job; rank 0, on another node, kept the record
            super().__init__(f"preempted by {signal_name}; rank 0's node records the step and checkpoint "
                             f"({RunDir.PREEMPTION} in its run directory)")
        else:
            super().__init__(f"preempted by {signal_name} at step {step}; {where}")


class PreemptionWatcher:
    """Installs handlers for the configured signals and remembers the first one received."""

    def __init__(self, signal_names: list[str]) -> None:
        self.received: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self.received_at = time.time()  # wall clock: compared across ranks

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()


class NullWatcher:
    """Used where signal handlers cannot be installed (not the main thread)."""

    received: str | None = None
    received_at: float | None = None
    requested = False

    def restore(self) -> None:
        pass
