"""The spike and NaN guard's decisions: which steps are kept, and when the run rolls back.

A step is judged on figures every rank already agrees on (the mean loss of the step's
agreement all-reduce and the global gradient norm), so every rank reaches the same
verdict without a collective of its own. A step is bad when its loss or gradient norm
is not finite, or, once ``warmup_steps`` steps have been kept, when its loss exceeds
the median of the last ``window`` kept losses by more than ``spike_mads`` median absolute
deviations. A bad step's update is dropped; ``bad_in_a_row`` bad steps in a row ask for
a rollback (the trainer restores its newest snapshot, or with ``snapshot_every = 0`` its
newest checkpoint, and skips those steps' samples), at most ``max_rollbacks`` times: one
more stops the run with ``GuardStop``.

After a rollback the steps from the restored one on are trained again. A step whose
number was judged before is a replay: its verdict says so (its record is marked), and
when the loss of that step number is already in the window, the replay's loss is not
added a second time, so the reference does not lean towards the replayed stretch.

This module holds no tensors and no torch: the trainer hands it floats and carries out
what it decides. Its state travels in checkpoints, so a resumed run judges as the
interrupted one would have.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from meshyard.config.sections import GuardConfig

# A flat loss has a MAD near zero, and then every wobble would be a spike: the spread is
# never taken as less than this share of the median.
MIN_SPREAD = 1e-3


class GuardStop(RuntimeError):
    """More rollbacks were needed than ``guard.max_rollbacks`` allows."""


@dataclass(frozen=True)
class Verdict:
    """The guard's judgement of one step."""

    keep: bool
    reason: str = ""  # why it was not kept: "non-finite loss", "non-finite gradient norm" or "loss spike"
    threshold: float | None = None  # the loss above which the step would have been a spike
    in_a_row: int = 0  # bad steps in a row, this one included
    roll_back: bool = False  # this step completes a run of bad steps: restore the snapshot
    replay: bool = False  # the step's number was judged before: it is trained again after a rollback


KEPT = Verdict(True)


class SpikeGuard:
    """Judges steps and counts rollbacks (one per run; identical on every rank)."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.kept = 0  # steps kept so far: the spike test starts after warmup_steps of them
        self.in_a_row = 0
        self.rollbacks = 0
        self.lr_steps_left = 0
        self.last_judged = 0  # the highest step number judged: a step up to it is a replay
        self.last_windowed = 0  # the highest step number whose loss is in the window

    def threshold(self) -> float | None:
        """The loss above which a step is a spike; None during warm-up."""
        if self.kept < self.cfg.warmup_steps or len(self.losses) < 3:
            return None
        median = statistics.median(self.losses)
        mad = statistics.median(abs(loss - median) for loss in self.losses)
        return median + self.cfg.spike_mads * max(mad, MIN_SPREAD * abs(median))

    def judge(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """The verdict on optimizer step ``step`` with this mean ``loss`` and global ``grad_norm``."""
        replay = step <= self.last_judged
        self.last_judged = max(self.last_judged, step)
        threshold = self.threshold()
        if not math.isfinite(loss):
            reason = "non-finite loss"
        elif not math.isfinite(grad_norm):
            reason = "non-finite gradient norm"
        elif threshold is not None and loss > threshold:
            reason = "loss spike"
        else:
            if step > self.last_windowed:  # a replayed step's first loss already counts
                self.losses.append(loss)
                self.kept += 1
                self.last_windowed = step
            self.in_a_row = 0
            self.lr_steps_left = max(self.lr_steps_left - 1, 0)
            return Verdict(True, replay=replay) if replay else KEPT
        self.in_a_row += 1
        return Verdict(False, reason, threshold, self.in_a_row, self.in_a_row >= self.cfg.bad_in_a_row, replay)

    def lr_factor(self) -> float:
        """What the scheduled learning rate is multiplied by now (lowered after a rollback)."""
        return self.cfg.lr_factor if self.lr_steps_left > 0 else 1.0

    def start_rollback(self, step: int, to_step: int, target: str = "snapshot") -> None:
        """Count a rollback from ``step`` to ``to_step`` (the step of the newest ``target``:
        "snapshot" or "checkpoint"); raises ``GuardStop`` past the limit."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise GuardStop(
                f"the spike and NaN guard stopped the run at step {step}: {self.in_a_row} bad steps in a row "
                f"(non-finite or spiking loss or gradient norm) called for rollback number {self.rollbacks + 1}, "
                f"but guard.max_rollbacks = {self.cfg.max_rollbacks} (the newest {target} is of step {to_step}; "
                "nothing was saved for this stop). Look at the steps in guard.jsonl and their samples, lower optim.lr, "
                "or raise guard.max_rollbacks or guard.spike_mads.")
        self.rollbacks += 1
        self.in_a_row = 0
        self.lr_steps_left = self.cfg.lr_steps

    # checkpoint state (the same on every rank) -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "kept": self.kept, "in_a_row": self.in_a_row,
                "rollbacks": self.rollbacks, "lr_steps_left": self.lr_steps_left,
                "last_judged": self.last_judged, "last_windowed": self.last_windowed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.kept, self.in_a_row = int(state["kept"]), int(state["in_a_row"])
        self.rollbacks, self.lr_steps_left = int(state["rollbacks"]), int(state["lr_steps_left"])
        # Checkpoints saved before replays were told apart carry neither: nothing is a replay.
        self.last_judged = int(state.get("last_judged", 0))
        self.last_windowed = int(state.get("last_windowed", 0))
