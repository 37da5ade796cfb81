"""Saving, committing, retaining and finding checkpoints.

A save goes: every rank writes its DCP shards into a staging location -> rank 0 writes
``trainer_state.json``, then the manifest (sizes and SHA-256 of every file, read back)
-> the checkpoint is published (local: renamed from ``step-N.partial`` to ``step-N``)
-> the ``latest`` pointer is replaced -> older checkpoints beyond the retention policy
are deleted. A crash at any point leaves the previous checkpoints valid and the new one
either complete or ignored.

Async saves copy the state to memory, return, and write in a background thread through a
process group of their own (DCP's collectives must not interleave with training's); at
most one save is in flight, and a failed one is reported, never silently dropped.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from meshyard.checkpoint.manifest import MANIFEST, build_manifest, verify
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass
class PendingSave:
    step: int
    staging: str
    final: str
    future: Future | None
    trainer_state: dict[str, Any]
    facts: dict[str, Any]
    started: float


@dataclass(frozen=True)
class SaveOutcome:
    step: int
    name: str | None  # None when the save failed
    error: str | None
    seconds: float


class CheckpointManager:
    """Owns one checkpoint root; call ``save`` at step boundaries and ``poll`` every step."""

    def __init__(self, cfg: CheckpointConfig, store: CheckpointStore, rank: int,
                 report: Callable[[str], None] = print, facts: dict[str, Any] | None = None) -> None:
        """``facts`` (world size, layout, config and its hash) go into every manifest."""
        self.cfg = cfg
        self.facts = dict(facts or {})
        self.store = store
        self.rank = rank
        self.report = report
        self._pending: PendingSave | None = None
        self.outcomes: list[SaveOutcome] = []
        self._last_save_started = time.monotonic()
        # DCP's async writer runs collectives from a background thread; on their own
        # gloo group they cannot interleave with the training step's collectives.
        self._group = dist.new_group(backend="gloo") if cfg.async_save else None
        if rank == 0:
            store.makedirs(store.root)
            self._remove_stale_staging()

    enabled = True

    @property
    def save_final(self) -> bool:
        return self.cfg.save_final

    def due(self, step: int) -> bool:
        return self.cfg.interval > 0 and step % self.cfg.interval == 0

    def time_due(self) -> bool:
        """Rank 0's clock decides time-based saves (the trainer spreads its answer)."""
        minutes = self.cfg.interval_minutes
        return self.rank == 0 and minutes > 0 and time.monotonic() - self._last_save_started >= minutes * 60

    def last_committed(self) -> str | None:
        names = [o.name for o in self.outcomes if o.name is not None]
        return self.store.url_of(names[-1]) if names else None

    # saving -----------------------------------------------------------------------
    def save(self, step: int, tensor_state: dict[str, Any], trainer_state: dict[str, Any],
             facts: dict[str, Any], blocking: bool = False) -> None:
        """Write a checkpoint of ``step``. ``blocking`` (or async_save off) returns after the
        commit; otherwise the write continues in the background."""
        self.wait()  # at most one save in flight
        self._last_save_started = time.monotonic()
        name = checkpoint_name(step)
        final = self.store.path(name)
        staging = self.store.path(self.store.staging_name(name))
        if self.rank == 0:
            self.store.remove_tree(staging)
            if staging != final:
                self.store.remove_tree(final)  # an invalid leftover of an earlier attempt
        dist.barrier()
        pending = PendingSave(step, staging, final, None, trainer_state, facts, time.perf_counter())
        writer = self.store.dcp_writer(staging)
        try:
            if blocking or not self.cfg.async_save:
                dcp.save(tensor_state, storage_writer=writer)
            else:
                pending.future = dcp.async_save(tensor_state, storage_writer=writer, process_group=self._group)
        except (Exception, CheckpointException) as exc:  # storage errors of synchronous saves
            self._fail(pending, exc)
            return
        self._pending = pending
        if pending.future is None:
            self._complete()

    def poll(self) -> None:
        """Commit a finished background save; cheap when none is pending."""
        if self._pending is not None and self._pending.future is not None and self._pending.future.done():
            self._complete()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and committed."""
        if self._pending is not None:
            if self._pending.future is not None:
                try:
                    self._pending.future.result()
                except (Exception, CheckpointException):
                    pass  # reported by _complete
            self._complete()

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        error = pending.future.exception() if pending.future is not None else None
        if error is not None:
            self._fail(pending, error)
            return
        if self.rank == 0:
            try:
                self._commit(pending)
            except Exception as exc:
                self._fail(pending, exc)
                return
        seconds = time.perf_counter() - pending.started
        self.outcomes.append(SaveOutcome(pending.step, checkpoint_name(pending.step), None, seconds))

    def _commit(self, pending: PendingSave) -> None:
        store = self.store
        store.write_text(f"{pending.staging}/{TRAINER_STATE}", _dumps(pending.trainer_state))
        manifest = build_manifest(store, pending.staging, {"step": pending.step, **self.facts, **pending.facts})
        store.write_text(f"{pending.staging}/{MANIFEST}", _dumps(manifest))
        if pending.staging != pending.final:
            store.remove_tree(pending.final)
        store.publish(pending.staging, pending.final)
        store.write_text(store.path(LATEST), checkpoint_name(pending.step) + "\n")
        self._apply_retention()

    def _fail(self, pending: PendingSave, error: BaseException) -> None:
        message = (f"checkpoint of step {pending.step} failed and was discarded ({_describe(error)}); "
                   f"earlier checkpoints are intact. Check free space and access to {self.store.url}.")
        self.report(message)
        self.outcomes.append(SaveOutcome(pending.step, None, str(error), time.perf_counter() - pending.started))
        if self.rank == 0:
            try:
                self.store.remove_tree(pending.staging)
            except Exception:
                pass  # the storage may still be failing; an invalid staging dir is ignored anyway

    # retention --------------------------------------------------------------------
    def committed(self) -> list[tuple[int, str]]:
        """(step, name) of checkpoints that have a manifest, oldest first (not verified)."""
        names = self.store.list_dir(self.store.root)
        found = [(step_of(n), n) for n in names if step_of(n) is not None]
        return sorted((s, n) for s, n in found if self.store.exists(self.store.path(n, MANIFEST)))

    def _apply_retention(self) -> None:
        checkpoints = self.committed()
        keep = {name for _, name in checkpoints[-self.cfg.keep_last:]}
        if self.cfg.keep_best:
            best = self._best_by_eval(checkpoints)
            if best:
                keep.add(best)
        for _, name in checkpoints:
            if name not in keep:
                self.store.remove_tree(self.store.path(name))

    def _best_by_eval(self, checkpoints: list[tuple[int, str]]) -> str | None:
        scored = []
        for _, name in checkpoints:
            loss = self.store.read_json(self.store.path(name, MANIFEST)).get("eval_loss")
            if loss is not None:
                scored.append((loss, name))
        return min(scored)[1] if scored else None

    def _remove_stale_staging(self) -> None:
        for name in self.store.list_dir(self.store.root):
            if name.endswith(".partial") or name.endswith(".tmp"):
                self.store.remove_tree(self.store.path(name))

    # finding ----------------------------------------------------------------------
    def latest_valid(self) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that verifies; invalid newer ones are reported and skipped."""
        return find_latest_valid(self.store, self.cfg.verify_checksums, self.report)


class NullCheckpointManager:
    """Checkpointing switched off: every question has the 'nothing to do' answer."""

    enabled = False
    save_final = False

    def __init__(self) -> None:
        self.outcomes: list[SaveOutcome] = []

    def due(self, step: int) -> bool:
        return False

    def time_due(self) -> bool:
        return False

    def last_committed(self) -> str | None:
        return None

    def save(self, *args: Any, **kwargs: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def wait(self) -> None:
        pass


def find_latest_valid(store: CheckpointStore, checksums: bool = True,
                      report: Callable[[str], None] = print) -> tuple[str, dict[str, Any]] | None:
    names = sorted((n for n in store.list_dir(store.root) if step_of(n) is not None), reverse=True)
    for name in names:
        manifest, problem = verify(store, store.path(name), checksums)
        if problem is None and manifest is not None:
            return name, manifest
        report(f"checkpoint {store.url_of(name)} is not valid: {problem}; trying the previous one")
    return None


def read_trainer_state(store: CheckpointStore, name: str) -> dict[str, Any]:
    return store.read_json(store.path(name, TRAINER_STATE))


def _describe(error: BaseException) -> str:
    """The root cause, not DCP's wrapper with every rank's traceback."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = next(iter(error.failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {error}"


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True)
