"""Python's garbage collector in a long-running job: what set-up made is frozen out of its
reach, and the time it still takes is measured.

A full collection walks every object the collector tracks, holding the GIL throughout.
Once torch is imported and a model compiled, a process holds 300k-600k of them, and one
full collection takes 0.2-0.6 s. Any thread can trigger it: on an H100 the writer of an
async checkpoint, allocating its plans, set one off that stopped the training thread for
398 ms. What exists after set-up (modules, compiled graphs, torch's own objects) lives
as long as the job, so ``freeze_long_lived`` collects once and moves every survivor to the
permanent generation; later collections walk only what was made since, in milliseconds.

``CollectorClock`` adds up the time collections take in any thread of the process, so a
step's record can say how much of it the collector had.
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze_long_lived() -> None:
    """Collect what is garbage now, then keep every live object out of later collections
    (``gc.freeze``). Objects frozen are never collected, even once unreachable: call it
    when set-up is done, and ``thaw`` when what it made may go."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (``gc.unfreeze``): a job that ends in
    a process that goes on (``nproc = 1``, a notebook) lets its model be collected. The
    freeze is the process's: whatever else froze objects in it is thawed too."""
    gc.unfreeze()


class CollectorClock:
    """Seconds spent in garbage collections, in any thread, since the last ``take``.

    The interpreter runs one collection at a time, but a collection's finalizers may let
    another thread run between its "start" and "stop" callbacks, ``take`` included. So the
    callback alone writes the running total and ``take`` alone writes what it has taken,
    and a "stop" without its "start" (the clock installed mid-collection) counts nothing.
    No lock: a collection set off inside ``take`` would wait on it for ever."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._total = 0.0  # written by the callback only
        self._taken = 0.0  # written by ``take`` only
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_collection)
            self._installed = False

    def take(self) -> float:
        """The seconds collected since the last call."""
        total = self._total
        seconds, self._taken = total - self._taken, total
        return seconds

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            self._total += now - self._began
            self._began = None


class RunCollector:
    """The collector over one training run: ``start`` freezes what set-up made, the first
    ``step_settled`` freezes again what the first step made (a compile's graphs, the
    optimizer's state), each ``step_settled`` says how long collections took since the
    last one, and ``stop`` thaws everything."""

    def __init__(self) -> None:
        self.clock = CollectorClock()
        self._first_step_frozen = False

    def start(self) -> None:
        self._first_step_frozen = False
        freeze_long_lived()
        self.clock.install()

    def step_settled(self) -> float:
        """Seconds of collections since the last step was settled (the first step's
        freeze, a full collection, goes to the second step)."""
        seconds = self.clock.take()
        if not self._first_step_frozen:
            self._first_step_frozen = True
            # With read-ahead the second step is in flight: its objects are frozen too and
            # stay until ``stop`` (only cycles among them are kept that long).
            freeze_long_lived()
        return seconds

    def stop(self) -> None:
        self.clock.remove()
        thaw()
