"""Hang detection: name the rank that did not reach the collective the others wait in.

Each rank runs a daemon thread. The training loop only sets two attributes as it moves
through a step (step number and phase), which costs nothing; the thread publishes them
to the job's rendezvous store about once a second. When this rank makes no progress for
``timeout`` seconds the thread dumps every Python stack of the process to
``<run dir>/hang/rank<N>.txt``, reads every rank's last published position from the
store and writes ``hang/report-rank<N>.json`` naming the ranks furthest behind: those are
the ones the others are waiting for. With ``abort`` the process then exits, so the
elastic agent can restart the job from its last checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

EXIT_HUNG = 124  # the exit status of timeout(1): the job was stopped for taking too long

# Where a rank can be within a step, in order. A rank that is behind in this order (or
# in steps) has not reached the collective that ranks further on are blocked in.
PHASES = ("starting", "data", "forward", "backward", "optimizer", "sync", "eval", "checkpoint", "finished")
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
    order = {rank: (p["step"], PHASES.index(p["phase"])) for rank, p in positions.items()}
    if len(set(order.values())) <= 1:
        return []
    earliest = min(order.values())
    return sorted(rank for rank, position in order.items() if position == earliest)


class HangWatchdog:
    def __init__(self, run_dir: Path, rank: int, world_size: int, store: dist.Store, timeout_s: float,
                 abort: bool, report: Callable[[str], None]) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.store, self.timeout, self.abort, self.report = store, timeout_s, abort, report
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

    def _run(self) -> None:
        interval = min(1.0, max(0.05, self.timeout / 5))
        while not self._stop.wait(interval):
            position = (self.step, self.phase)
            now = time.monotonic()
            if position != self._seen:
                self._seen, self._last_change = position, now
            self._publish()
            if not self.fired and now - self._last_change > self.timeout:
                self.fired = True
                self._on_hang(now - self._last_change)

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

    def _on_hang(self, stalled_for: float) -> None:
        hang_dir = self.run_dir / "hang"
        hang_dir.mkdir(parents=True, exist_ok=True)
        with open(hang_dir / f"rank{self.rank}.txt", "w") as out:
            out.write(f"rank {self.rank} made no progress for {stalled_for:.1f}s at step {self.step}, "
                      f"phase {self.phase}\n\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        time.sleep(min(2.0, self.timeout))  # let the other ranks publish their last position
        positions = self._positions()
        behind = laggards(positions)
        waiting_in = {p["phase"] for r, p in positions.items() if r not in behind}
        report = {
            "rank": self.rank, "stalled_s": stalled_for, "step": self.step, "phase": self.phase,
            "positions": positions, "behind": behind, "missing": sorted(set(range(self.world_size)) - set(positions)),
            "others_wait_in": sorted(COLLECTIVE_OF_PHASE.get(p, p) for p in waiting_in),
        }
        (hang_dir / f"report-rank{self.rank}.json").write_text(json.dumps(report, indent=2))
        if behind:
            where = ", ".join(f"rank {r} (step {positions[r]['step']}, {positions[r]['phase']})" for r in behind)
            message = (f"hang: no progress for {stalled_for:.0f}s; the other ranks wait in "
                       f"{' / '.join(report['others_wait_in']) or 'a collective'} for {where}")
        else:
            message = (f"hang: no progress for {stalled_for:.0f}s; every rank is at step {self.step}, "
                       f"phase {self.phase} (a collective that never completes)")
        self.report(f"{message}. Stacks in {hang_dir}/rank*.txt")
        if self.abort:
            os._exit(EXIT_HUNG)


class NullWatchdog:
    fired = False

    def at(self, phase: str, step: int | None = None) -> None:
        pass

    def stop(self) -> None:
        pass
