"""Where the spike and NaN guard rolls a run back to, chosen by ``guard.snapshot_every``.

``SnapshotRollback`` (every N steps) keeps an in-memory copy of the training state on the
host (``train.snapshot``). ``CheckpointRollback`` (``snapshot_every = 0``) keeps nothing:
it rolls back to this run's newest committed checkpoint from before the bad steps,
loaded in-process through the checkpointer's own load path, so it costs no host memory
and no copy per snapshot, at the price of reading a checkpoint and of going back as far
as ``checkpoint.interval``.

Both restore the model, optimizer, schedule, loss scaler and RNG, and hand back the step
and the tokens seen they hold. What a rollback does not undo stays as it is: the guard's
own state (its window, its count of rollbacks), the data stream's skip list (which the
trainer then extends), the run's cost so far and its best evaluation loss.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import nn

from meshyard.checkpoint.checkpointer import Checkpointer
from meshyard.checkpoint.manager import step_of
from meshyard.checkpoint.resume import ResumePoint
from meshyard.fault.guard import GuardStop
from meshyard.train.precision import Precision
from meshyard.train.snapshot import Snapshot, restore_snapshot, take_snapshot
from meshyard.train.state import TrainProgress

# The checkpointer's shared parts a rollback to a checkpoint loads: the data position and
# the guard's state are the live run's (see the module docstring).
ROLLED_BACK_PARTS = ("progress", "scheduler", "scaler")


class Restored(NamedTuple):
    step: int
    tokens_seen: int


class RollbackTarget(Protocol):
    kind: str  # how messages and guard.jsonl name it: "snapshot" or "checkpoint"

    def due(self, step: int) -> bool:
        """Whether a copy of the state after ``step`` is to be taken."""

    def take(self, step: int, tokens_seen: int) -> None:
        """Copy the state after ``step`` (nothing in flight)."""

    def newest(self, at_most: int) -> int:
        """The step of the newest state of step ``at_most`` or earlier that ``restore`` will
        return to; raises ``GuardStop`` when there is none."""

    def restore(self) -> Restored:
        """Put the state ``newest`` found back into the live training objects."""


class SnapshotRollback:
    """Host snapshots every ``every`` steps (never of a step in a run of bad ones: the
    trainer does not take one then)."""

    kind = "snapshot"

    def __init__(self, every: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, precision: Precision, device: torch.device) -> None:
        self.every = every
        self.model, self.optimizer, self.scheduler, self.precision, self.device = \
            model, optimizer, scheduler, precision, device
        self.snapshot: Snapshot | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, step: int, tokens_seen: int) -> None:
        self.snapshot = take_snapshot(step, tokens_seen, self.model, self.optimizer, self.scheduler,
                                      self.precision.scaler, self.device)

    def newest(self, at_most: int) -> int:
        assert self.snapshot is not None and self.snapshot.step <= at_most, "a snapshot is taken when fit starts"
        return self.snapshot.step

    def restore(self) -> Restored:
        assert self.snapshot is not None
        restore_snapshot(self.snapshot, self.model, self.optimizer, self.scheduler, self.precision.scaler,
                         self.device)
        return Restored(self.snapshot.step, self.snapshot.tokens_seen)


class CheckpointRollback:
    """This run's newest committed checkpoint from before the bad steps."""

    kind = "checkpoint"

    def __init__(self, checkpointer: Checkpointer, progress: TrainProgress) -> None:
        self.checkpointer = checkpointer
        self.progress = progress
        self.point: ResumePoint | None = None

    def due(self, step: int) -> bool:
        return False  # the checkpointer saves on its own schedule

    def take(self, step: int, tokens_seen: int) -> None:
        pass

    def newest(self, at_most: int) -> int:
        self.point = self.checkpointer.newest_own(at_most)
        if self.point is None:
            raise GuardStop(
                f"the spike and NaN guard stopped the run: bad steps from step {at_most + 1} on called for a "
                "rollback, and with guard.snapshot_every = 0 it returns to the newest checkpoint of this run, but "
                f"none of step {at_most} or earlier was committed (checkpoint.enabled = "
                f"{str(self.checkpointer.enabled).lower()}, checkpoint.interval = {self.checkpointer.cfg.interval}). "
                "Enable checkpoints with a checkpoint.interval shorter than the stretch to protect, or set "
                "guard.snapshot_every to a number of steps to keep host snapshots instead.")
        return step_of(self.point.name) or 0

    def restore(self) -> Restored:
        assert self.point is not None
        progress = self.progress
        kept = progress.cost_so_far, progress.best_eval_loss  # spent and seen: not undone
        self.checkpointer.load(self.point, parts=ROLLED_BACK_PARTS)
        progress.cost_so_far, progress.best_eval_loss = kept
        return Restored(progress.step, progress.tokens_seen)
