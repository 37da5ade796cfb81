"""The one object that saves and loads a run's training state.

``TrainingState`` bundles the ``Stateful`` parts a checkpoint holds: the model and its
optimizer (DCP, resharded on load), the parts that are the same on every rank
(counters, LR schedule, loss scaler, data position: JSON written by rank 0), parts of
each rank's own (gradient-compression residuals: DCP under a per-rank key) and each
rank's RNG states. ``Checkpointer`` turns that bundle into a checkpoint through the
``CheckpointManager`` (atomic commit, retention, async writes) and back, and answers
the training loop's questions about when to save.

Save and load take the same path in opposite directions, so a part added to the bundle
is saved and restored without any other change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from meshyard.checkpoint.manager import (CheckpointManager, NullCheckpointManager, SaveOutcome, read_trainer_state,
                                         step_of)
from meshyard.checkpoint.resume import ResumePoint, agree_resume_point
from meshyard.checkpoint.state import (SafeLoadPlanner, Stateful, load_tensor_state, new_rng_blob,
                                       optimizer_holds_state, tensor_state)
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig
from meshyard.runtime.distributed import rank0_decides


@dataclass
class TrainingState:
    """What a checkpoint holds, as ``Stateful`` parts.

    ``shared``: identical on every rank, saved as JSON by rank 0 under each name, loaded
    in the order given. ``per_rank``: tensors of each rank's own, saved under
    ``<name>.rank<N>``. ``zero1``: the optimizer partitions its state over the replicas.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    shared: dict[str, Stateful] = field(default_factory=dict)
    per_rank: dict[str, Stateful] = field(default_factory=dict)
    zero1: bool = False


class Checkpointer:
    """Saves and restores a ``TrainingState`` through a checkpoint manager."""

    def __init__(self, manager: CheckpointManager | NullCheckpointManager, state: TrainingState, rank: int,
                 cfg: CheckpointConfig) -> None:
        self.manager = manager
        self.state = state
        self.rank = rank
        self.cfg = cfg
        self.saved_step = -1  # the step of the last save or load: no final save needed there
        # Kept from save to save (and filled by loads), so an async save stages it into
        # the same host buffer every time.
        self._rng_blob = new_rng_blob()
        self._staging_warmed = False  # the model's part, while the optimizer has no state yet
        self._staged_whole = False  # an async save staged model and optimizer state

    # when to save (the manager's policy) ----------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.manager.enabled

    @property
    def save_final(self) -> bool:
        return self.manager.save_final

    @property
    def outcomes(self) -> list[SaveOutcome]:
        return self.manager.outcomes

    def due(self, step: int) -> bool:
        return self.manager.due(step)

    def time_due(self) -> bool:
        return self.manager.time_due()

    def poll(self) -> None:
        self.manager.poll()

    def wait_staged(self) -> float | None:
        """Until an async save has copied the state (before the optimizer changes it);
        returns the seconds waited, None when no copy was pending."""
        return self.manager.wait_staged()

    def wait(self) -> None:
        self.manager.wait()

    def warm_staging(self) -> bool:
        """Where async saves stage into pinned host buffers (on CUDA), allocate and pin
        them now, outside the training steps, by staging the state once; the first save
        finds them ready. Returns whether that is done (always, where there is nothing to
        pin). False while the optimizer has no state: before its first step there is none
        to stage, and building it here would count an optimizer step. The model's part is
        warmed then, and a call after an optimizer step warms the rest."""
        if not self.manager.stages_to_pinned_memory or self._staged_whole:
            return True
        ready = optimizer_holds_state(self.state.optimizer, self.state.zero1)
        if ready or not self._staging_warmed:
            # A save still writing reads these very buffers (a save came first: the guard
            # can drop every step before it): staging again under it would mix two steps.
            self.manager.wait()
            self.manager.warm_staging(self._tensor_state(with_optimizer=ready))
            self._staging_warmed = True
        return ready

    def last_committed(self) -> str | None:
        return self.manager.last_committed()

    def close(self) -> None:
        self.manager.close()

    # save and load --------------------------------------------------------------------------
    def save(self, step: int, facts: dict[str, Any], blocking: bool = False) -> None:
        """Checkpoint the bundle at ``step``; ``facts`` (eval loss, tokens seen, ...) go
        into the manifest."""
        # The previous save's copy must be taken before the buffers kept across saves (the
        # RNG blob, compression state) are refilled; the trainer has normally waited already.
        self.manager.wait_staged()
        tensors = self._tensor_state()
        shared = {name: part.state_dict() for name, part in self.state.shared.items()}
        self.manager.save(step, tensors, shared, facts, blocking=blocking)
        if not blocking and optimizer_holds_state(self.state.optimizer, self.state.zero1):
            self._staged_whole = True  # the host buffers of the whole state exist: nothing left to warm
        self.saved_step = step

    def _tensor_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        state = self.state
        return tensor_state(state.model, state.optimizer, self.rank, state.per_rank, state.zero1, self._rng_blob,
                            with_optimizer)

    def load(self, point: ResumePoint, parts: tuple[str, ...] | None = None) -> bool:
        """Fill the bundle from ``point``; returns whether this rank's RNG state was
        restored (only when a rank of that number saved one). ``parts``: the shared parts
        to load (all when None; the guard's rollback leaves its own state and the data
        stream's skip list as they are)."""
        state = self.state
        store = CheckpointStore(point.root, self.cfg.storage_options)
        location = store.path(point.name)
        shared = read_trainer_state(store, point.name)
        saved_keys = set(store.dcp_reader(location).read_metadata().state_dict_metadata)
        self.manager.wait_staged()  # the load fills the buffers kept across saves
        restored_rng = load_tensor_state(
            lambda tensors: dcp.load(tensors, storage_reader=store.dcp_reader(location), planner=SafeLoadPlanner()),
            state.model, state.optimizer, self.rank, saved_keys, state.per_rank, state.zero1, self._rng_blob,
        )
        for name, part in state.shared.items():
            if parts is not None and name not in parts:
                continue
            if name in shared:  # a part added since that checkpoint was saved (the guard's) starts afresh
                part.load_state_dict(shared[name])
        self.saved_step = int(shared["progress"]["step"]) if "progress" in shared else -1
        return restored_rng

    def newest_own(self, at_most: int) -> ResumePoint | None:
        """This run's newest committed checkpoint of step ``at_most`` or earlier, the same
        on every rank (rank 0 reads the manifests; a save in flight is committed first);
        None without one."""
        if not self.enabled:
            return None
        self.wait()
        manager = self.manager
        assert isinstance(manager, CheckpointManager)

        def newest() -> ResumePoint | None:
            own = [(step_of(name) or 0, name, manifest) for name, manifest in manager.own_committed()]
            earlier = [entry for entry in own if entry[0] <= at_most]
            if not earlier:
                return None
            _, name, manifest = max(earlier, key=lambda entry: entry[0])
            return ResumePoint(manager.store.url, name, manifest, self.cfg.storage_options)

        return rank0_decides(newest)

    def choose(self, resume: str, own_root: str, restarted: bool, report: Callable[[str], None],
               world_size: int) -> ResumePoint | None:
        """The checkpoint every rank starts from (None: a fresh start), checked by all
        ranks together (``agree_resume_point``); ``load`` it next."""
        return agree_resume_point(resume, own_root, self.cfg, restarted, report, self.rank, world_size)
