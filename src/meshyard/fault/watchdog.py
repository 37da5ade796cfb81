"""Hang detection: name the rank that did not reach the collective the others wait in.

Each rank runs a daemon thread. The training loop only sets two attributes as it moves
through a step (step number and phase), which costs nothing; the thread publishes them
to the job's rendezvous store about once a second. When this rank makes no progress for
``timeout`` seconds the thread dumps every Python stack of the process to
``<run dir>/hang/rank<N>.txt``, reads every rank's last published position from the
store and writes ``hang/report-rank<N>.json`` naming the ranks furthest behind: those are
the ones the others are waiting for. Ranks are named with their hosts (gathered once at
start, ``runtime/hosts.py``), since the machine is what a person goes to look at. With
``abort`` the process then exits, so the elastic agent can restart the job from its last
checkpoint.

Start-up (building the data and the model, loading and verifying a checkpoint) is one
long phase, ``starting``, that can take far longer than a step without anything being
wrong; it has its own allowance, ``startup_timeout``. The step ``timeout`` applies from
the first step on. Either is 0 to leave that part unwatched.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

from meshyard.metrics.schema import PHASES
from meshyard.run_dir import RunDir
from meshyard.runtime.hosts import host_of, rank_on_host

EXIT_HUNG = 124  # the exit status of timeout(1): the job was stopped for taking too long

# Where a rank can be, in order. A rank that is behind in this order (or in steps) has
# not reached the collective that ranks further on are blocked in. Within a step these
# are the timed phases except "comm": exposed communication is time spread over the step,
# not one place; the collective a rank blocks in is the step's loss-and-flags all-reduce,
# waited for after the optimizer step ("sync").
WATCHED_POSITIONS = ("starting", *(phase for phase in PHASES if phase != "comm"), "sync", "eval", "checkpoint",
                     "finished")
COLLECTIVE_OF_PHASE = {
    "forward": "forward collectives (FSDP all-gathers, tensor-parallel all-reduces)",
    "backward": "gradient all-reduce / reduce-scatter",
    "optimizer": "optimizer collectives (ZeRO-1 broadcast, gradient-norm all-reduce)",
    "sync": "the step's loss-and-flags all-reduce",
    "eval": "evaluation loss all-reduce",
    "checkpoint": "checkpoint save collectives",
}


def _key(rank: int) -> str:
    return f"meshyard/watchdog/rank{rank}"


def laggards(positions: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks at the earliest (step, phase) when ranks disagree; empty when all agree."""
    order = {rank: (p["step"], WATCHED_POSITIONS.index(p["phase"])) for rank, p in positions.items()}
    if len(set(order.values())) <= 1:
        return []
    earliest = min(order.values())
    return sorted(rank for rank, position in order.items() if position == earliest)


class HangWatchdog:
    """Watches this rank's progress from a daemon thread (module docstring).

    ``hosts``: every rank's host label, indexed by rank (``gather_host_labels``), so that
    a hung rank is named with its host; empty when they were not gathered."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, store: dist.Store, timeout_s: float,
                 abort: bool, report: Callable[[str], None], startup_timeout_s: float = 0.0,
                 hosts: Sequence[str] = ()) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.hosts = list(hosts)
        self.store, self.timeout, self.abort, self.report = store, timeout_s, abort, report
        self.startup_timeout = startup_timeout_s
        self.step, self.phase = 0, "starting"
        self._seen = (0, "starting")
        self._last_change = time.monotonic()
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._run, name=f"meshyard-watchdog-rank{rank}", daemon=True)
        self._thread.start()

    def at(self, phase: str, step: int | None = None) -> None:
        """Called by the training loop at each phase change (attribute writes only)."""
        self.phase = phase
        if step is not None:
            self.step = step

    def stop(self) -> None:
        self.phase = "finished"
        self._stop.set()
        self._thread.join(timeout=5)

    def _limit(self) -> float:
        """Seconds without progress that make a hang where this rank is now (0: none)."""
        return self.startup_timeout if self.phase == "starting" else self.timeout

    def _run(self) -> None:
        watched = [t for t in (self.timeout, self.startup_timeout) if t > 0] or [5.0]
        interval = min(1.0, max(0.05, min(watched) / 5))
        while not self._stop.wait(interval):
            position = (self.step, self.phase)
            now = time.monotonic()
            if position != self._seen:
                # Progress re-arms the alarm: a slow start-up that was reported must not
                # keep a later hang in a step from being reported.
                self._seen, self._last_change, self.fired = position, now, False
            self._publish()
            limit = self._limit()
            if not self.fired and limit > 0 and now - self._last_change > limit:
                self.fired = True
                self._on_hang(now - self._last_change, limit)

    def _publish(self) -> None:
        try:
            self.store.set(_key(self.rank), json.dumps({"step": self.step, "phase": self.phase, "time": time.time()}))
        except Exception:  # the store may be gone when the job is tearing down
            pass

    def _positions(self) -> dict[int, dict[str, Any]]:
        positions = {}
        for rank in range(self.world_size):
            try:
                if self.store.check([_key(rank)]):
                    positions[rank] = json.loads(self.store.get(_key(rank)))
            except Exception:
                continue
        return positions

    def _on_hang(self, stalled_for: float, limit: float) -> None:
        starting = self.phase == "starting"  # before the pause below, in which it may change
        dumps = RunDir(self.run_dir)
        hang_dir = dumps.hang
        hang_dir.mkdir(parents=True, exist_ok=True)
        with open(dumps.hang_stacks(self.rank), "w") as out:
            out.write(f"{rank_on_host(self.rank, host_of(self.hosts, self.rank))} made no progress for "
                      f"{stalled_for:.1f}s at step {self.step}, phase {self.phase}\n\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        time.sleep(min(2.0, limit))  # let the other ranks publish their last position
        positions = self._positions()
        behind = laggards(positions)
        waiting_in = {p["phase"] for r, p in positions.items() if r not in behind}
        report = {
            "rank": self.rank, "host": host_of(self.hosts, self.rank), "stalled_s": stalled_for, "timeout_s": limit,
            "step": self.step, "phase": self.phase, "positions": positions, "behind": behind,
            "missing": sorted(set(range(self.world_size)) - set(positions)),
            "others_wait_in": sorted(COLLECTIVE_OF_PHASE.get(p, p) for p in waiting_in),
            "hosts": self.hosts,
        }
        dumps.hang_report(self.rank).write_text(json.dumps(report, indent=2))
        message = startup_message(stalled_for, limit) if starting else hang_message(report)
        self.report(f"{message}. Stacks in {hang_dir}/rank*.txt")
        if self.abort:
            os._exit(EXIT_HUNG)


def startup_message(stalled_for: float, limit: float) -> str:
    """A start-up that went past ``fault.startup_timeout_s``."""
    return (f"hang: start-up (building data and model, loading a checkpoint) made no progress for "
            f"{stalled_for:.0f}s, more than fault.startup_timeout_s = {limit:g}; raise it if start-up is only slow")


def hang_message(report: dict[str, Any]) -> str:
    """A hang report (``hang/report-rank<N>.json``, positions keyed by int rank) in one
    line: the ranks behind, with their hosts, that the others wait for, or that every rank
    waits in one collective; and the ranks that never published a position (never
    started, or stuck before the watchdog's first beat)."""
    stalled_for, positions, hosts, missing = (report[key] for key in ("stalled_s", "positions", "hosts", "missing"))
    if report["behind"]:
        where = ", ".join(f"{rank_on_host(r, host_of(hosts, r))} (step {positions[r]['step']}, "
                          f"{positions[r]['phase']})" for r in report["behind"])
        message = (f"hang: no progress for {stalled_for:.0f}s; the other ranks wait in "
                   f"{' / '.join(report['others_wait_in']) or 'a collective'} for {where}")
    else:
        message = (f"hang: no progress for {stalled_for:.0f}s; every rank{' heard from' if missing else ''} is at "
                   f"step {report['step']}, phase {report['phase']} (a collective that never completes)")
    if missing:
        silent = ", ".join(rank_on_host(r, host_of(hosts, r)) for r in missing)
        message += f"; no position ever came from {silent}"
    return message


class NullWatchdog:
    fired = False

    def at(self, phase: str, step: int | None = None) -> None:
        pass

    def stop(self) -> None:
        pass
