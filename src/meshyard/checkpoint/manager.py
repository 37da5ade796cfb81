"""Saving, committing, retaining and finding checkpoints.

A save goes: every rank writes its DCP shards into a staging location and records the
sizes and SHA-256 of its own files (``digests``) -> rank 0 writes ``trainer_state.json``,
then the manifest (every rank's record merged) -> the checkpoint is published (local:
renamed from ``step-N.<run id>.partial`` to ``step-N``) -> the ``latest`` pointer is
replaced -> this run's older checkpoints beyond the retention policy are deleted. A crash
at any point leaves the previous checkpoints valid and the new one either complete or
ignored.

Async saves copy the state to memory, return, and write in a background thread through a
process group of their own (DCP's collectives must not interleave with training's); rank
0 commits in that thread too, after the write, with file operations only (no collective).
At most one save is in flight, and a failed one is reported, never silently dropped.

When the manager opens the checkpoint root, the ranks check together that they all see
the same storage (``shared``): a local folder that is not common to every node is
refused before any save or load.

Several runs may share one checkpoint folder: every manifest carries the id of the run
that saved it, and a run deletes only its own partial saves and retired checkpoints, and
never writes over another run's checkpoint.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from meshyard.checkpoint.digests import DCP_METADATA, collect_records, digest_files, remove_records
from meshyard.checkpoint.manifest import MANIFEST, build_manifest, owner, verify
from meshyard.checkpoint.shared import require_shared_storage
from meshyard.checkpoint.staging import HostStager
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig
from meshyard.runtime.distributed import rank0_decides
from meshyard.runtime.gil_turns import SHORT_TURNS

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
# Marks an in-place save (object stores: no staging name) as this run's until its manifest does.
OWNER_MARKER = "run_id.txt"
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
    commit_s: float = 0.0  # rank 0's commit (in the background for async saves)


class CheckpointConflict(OSError):
    """The checkpoint name this run would write holds another run's checkpoint."""


def new_run_id() -> str:
    """A fresh run id (runs keep theirs in the run directory: ``run_dir.run_id_of``)."""
    return uuid.uuid4().hex[:12]


def agreed_run_id(run_id: str | None) -> str:
    """``run_id``, or else rank 0's new one on every rank: ranks stage their shards under
    the run id, so one job must never hold two."""
    if run_id:
        return run_id
    box = [new_run_id() if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


class CheckpointManager:
    """Owns one checkpoint root; call ``save`` at step boundaries and ``poll`` every step."""

    def __init__(self, cfg: CheckpointConfig, store: CheckpointStore, rank: int,
                 report: Callable[[str], None] = print, facts: dict[str, Any] | None = None,
                 run_id: str | None = None, device: torch.device | None = None) -> None:
        """``facts`` (world size, layout, config and its hash) go into every manifest.
        ``run_id`` (the same on every rank) marks this run's checkpoints; keep it across
        restarts of the run, or its older checkpoints count as another run's. Without
        one, every rank takes rank 0's new id (a collective: every rank constructs).
        ``device``: where the training state lives; on CUDA async saves copy it into pinned
        host buffers on a side stream (checkpoint/staging.py)."""
        self.cfg = cfg
        self.facts = dict(facts or {})
        self.store = store
        self.rank = rank
        self.world_size = dist.get_world_size()
        self.run_id = agreed_run_id(run_id)
        self.report = report
        self._pending: PendingSave | None = None
        self.outcomes: list[SaveOutcome] = []
        self._last_save_started = time.monotonic()
        # DCP's async writer runs collectives from a background thread; on their own
        # gloo group they cannot interleave with the training step's collectives.
        self._group = dist.new_group(backend="gloo") if cfg.async_save else None
        self._background = ThreadPoolExecutor(1, "meshyard-checkpoint") if cfg.async_save else None
        # Async saves stage (copy the state off the device) on a background thread while the
        # next step's forward and backward run; its host buffers are kept from one save to
        # the next. The trainer waits for the copy before the optimizer changes the state.
        self._stager = HostStager(device or torch.device("cpu")) if cfg.async_save else None
        self._staging: Future | None = None
        rank0_decides(self._prepare_root)  # a failure there is raised on every rank, none left waiting
        # Before any save or load: ranks on nodes without a common folder are refused now,
        # not at the first commit.
        require_shared_storage(store, rank, self.world_size, _folder_label(cfg, store), tag=self.run_id)

    enabled = True

    def _prepare_root(self) -> None:
        """Rank 0 creates the root and removes what a crashed earlier start of this run left."""
        self.store.makedirs(self.store.root)
        self._remove_stale_staging()

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
        staging = self.store.path(self._staging_name(name))
        pending = PendingSave(step, staging, final, None, trainer_state, facts, time.perf_counter())
        refused = self._agree_on_target(staging, final)
        if refused is not None:
            self._fail(pending, refused, discard=not isinstance(refused, CheckpointConflict))
            return
        in_background = self.cfg.async_save and not blocking
        writer = self.store.dcp_writer(staging, rank=self.rank, host_staged=in_background)
        try:
            if not in_background:
                dcp.save(tensor_state, storage_writer=writer)
            else:
                # The save's threads run Python beside the training thread until the commit:
                # short GIL turns keep the training thread's waits short (runtime/gil_turns.py).
                SHORT_TURNS.enter()
                try:
                    response = dcp.async_save(tensor_state, storage_writer=writer, process_group=self._group,
                                              async_stager=self._stager)
                    if isinstance(response, AsyncSaveResponse):
                        self._staging, written = response.staging_completion, response.upload_completion
                    else:  # staged before async_save returned
                        written = response
                    assert self._background is not None
                    pending.future = self._background.submit(self._commit_when_written, written, pending)
                except BaseException:
                    if pending.future is None:  # else the background part leaves, when it ends
                        SHORT_TURNS.leave()
                    raise
        except (Exception, CheckpointException) as exc:  # storage errors of synchronous saves
            self._fail(pending, exc)
            return
        self._pending = pending
        if pending.future is None:
            self._complete()

    def wait_staged(self) -> float | None:
        """Block until the in-flight save has its copy of the state (call before anything
        changes the state: the optimizer step); returns the seconds waited, None when no
        copy was pending. A staging failure is reported with the save."""
        staging, self._staging = self._staging, None
        if staging is None:
            return None
        start = time.perf_counter()
        try:
            staging.result()
        except (Exception, CheckpointException):
            pass  # the write fails with it and _complete reports that
        return time.perf_counter() - start

    @property
    def stages_to_pinned_memory(self) -> bool:
        """Whether async saves copy the state into pinned host buffers (the state is on CUDA)."""
        return self._stager is not None and self._stager.pins_memory

    def warm_staging(self, tensor_state: dict[str, Any]) -> None:
        """Allocate (and pin) the host buffers async saves stage ``tensor_state`` into."""
        if self._stager is not None:
            self._stager.warm(tensor_state)

    def close(self) -> None:
        """Let the background writer's thread go once its work is done (it is not waited for)."""
        if self._background is not None:
            self._background.shutdown(wait=False)
        if self._stager is not None:
            self._stager.close()

    def _staging_name(self, name: str) -> str:
        """Local saves are staged under a name of this run's (runs sharing the folder
        never collide); object stores are written in place."""
        return f"{name}.{self.run_id}.partial" if self.store.is_local else name

    def _agree_on_target(self, staging: str, final: str) -> BaseException | None:
        """Rank 0 clears this run's leftovers at the target, or refuses a target that holds
        another run's checkpoint; every rank learns the answer (which also keeps every
        rank from writing before rank 0 has cleared)."""
        answer: list[BaseException | None] = [None]
        if self.rank == 0:
            try:
                self._claim(staging, final)
            except Exception as exc:  # handed to every rank: none may wait for a save that will not happen
                answer[0] = exc
        if self.world_size > 1:
            dist.broadcast_object_list(answer, src=0)
        return answer[0]

    def _claim(self, staging: str, final: str) -> None:
        self._refuse_foreign(final)
        self.store.remove_tree(staging)
        if staging == final:  # in place: mark it as this run's until the manifest does
            self.store.makedirs(staging)
            self.store.write_text(f"{staging}/{OWNER_MARKER}", self.run_id, self.run_id)

    def _owner_of(self, directory: str) -> str | None:
        found = owner(self.store, directory)
        marker = f"{directory}/{OWNER_MARKER}"
        if found is None and self.store.exists(marker):
            return self.store.read_text(marker).strip()
        return found

    def _refuse_foreign(self, directory: str) -> None:
        found = self._owner_of(directory)
        if found is not None and found != self.run_id:
            raise CheckpointConflict(
                f"{directory} already holds a checkpoint of another run ({found or 'one without a run id'}), "
                "which is left alone; give each run its own checkpoint.dir")

    def poll(self) -> None:
        """Commit a finished background save; cheap when none is pending."""
        if self._pending is not None and self._pending.future is not None and self._pending.future.done():
            self._complete()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and committed."""
        self.wait_staged()
        if self._pending is not None:
            if self._pending.future is not None:
                try:
                    self._pending.future.result()
                except (Exception, CheckpointException):
                    pass  # reported by _complete
            self._complete()

    def _complete(self) -> None:
        """Record the outcome of the save (committing it first when it was blocking)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            commit_s = self._commit_timed(pending) if pending.future is None else pending.future.result()
        except (Exception, CheckpointException) as exc:
            self._fail(pending, exc)
            return
        seconds = time.perf_counter() - pending.started
        self.outcomes.append(SaveOutcome(pending.step, checkpoint_name(pending.step), None, seconds, commit_s))

    def _commit_when_written(self, written: Future, pending: PendingSave) -> float:
        """The background part of an async save: DCP's write, then rank 0's commit. The
        commit is file operations only, never a collective, so running it beside the
        training thread cannot deadlock."""
        try:
            written.result()
            return self._commit_timed(pending)
        finally:
            SHORT_TURNS.leave()  # the save's last Python beside the training thread is done

    def _commit_timed(self, pending: PendingSave) -> float:
        start = time.perf_counter()
        if self.rank == 0:
            self._commit(pending)
        return time.perf_counter() - start

    def _commit(self, pending: PendingSave) -> None:
        store, staging, tag = self.store, pending.staging, self.run_id
        store.write_text(f"{staging}/{TRAINER_STATE}", _dumps(pending.trainer_state), tag)
        files = collect_records(store, staging, self.world_size)
        files.update(digest_files(store, staging, [DCP_METADATA, TRAINER_STATE], rank=0))  # rank 0 wrote these
        remove_records(store, staging, self.world_size)
        facts = {"step": pending.step, **self.facts, **pending.facts, "run_id": self.run_id}
        store.write_text(f"{staging}/{MANIFEST}", _dumps(build_manifest(files, facts)), tag)
        if staging == pending.final:  # the manifest names the owner from now on
            store.fs.rm(f"{staging}/{OWNER_MARKER}")
        else:
            self._refuse_foreign(pending.final)  # another run may have published this name meanwhile
            store.remove_tree(pending.final)
        store.publish(staging, pending.final)
        store.write_text(store.path(LATEST), checkpoint_name(pending.step) + "\n", tag)
        self._apply_retention()

    def _fail(self, pending: PendingSave, error: BaseException, discard: bool = True) -> None:
        """Report a failed save; ``discard`` removes what it wrote (not when the target
        was refused: then it is another run's)."""
        message = (f"checkpoint of step {pending.step} failed and was discarded ({_describe(error)}); "
                   f"earlier checkpoints are intact. Check free space and access to {self.store.url}.")
        self.report(message)
        self.outcomes.append(SaveOutcome(pending.step, None, str(error), time.perf_counter() - pending.started))
        if self.rank == 0 and discard:
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

    def own_committed(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, manifest) of this run's committed checkpoints, oldest first."""
        own = []
        for _, name in self.committed():
            try:
                manifest = self.store.read_json(self.store.path(name, MANIFEST))
            except (OSError, ValueError):
                continue  # gone or unreadable: not provably this run's, so never deleted
            if manifest.get("run_id") == self.run_id:
                own.append((name, manifest))
        return own

    def _apply_retention(self) -> None:
        """Delete this run's checkpoints beyond the policy; other runs' are never touched."""
        own = self.own_committed()
        keep = {name for name, _ in own[-self.cfg.keep_last:]}
        scored = [(m["eval_loss"], name) for name, m in own if m.get("eval_loss") is not None]
        if self.cfg.keep_best and scored:
            keep.add(min(scored)[1])
        for name, _ in own:
            if name not in keep:
                self.store.remove_tree(self.store.path(name))

    def _remove_stale_staging(self) -> None:
        """Partial saves and temporary files this run left behind (a crash mid-save); those
        of other runs sharing the folder may be in progress and stay."""
        for name in self.store.list_dir(self.store.root):
            if name.endswith(f".{self.run_id}.partial") or (name.endswith(".tmp") and f".{self.run_id}." in name):
                self.store.remove_tree(self.store.path(name))


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

    stages_to_pinned_memory = False

    def warm_staging(self, tensor_state: dict[str, Any]) -> None:
        pass

    def wait_staged(self) -> float | None:
        return None

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def find_latest_valid(store: CheckpointStore, checksums: bool = True, report: Callable[[str], None] = print,
                      rejected: Collection[str] = ()) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint under ``store`` that verifies (all of its files' checksums on
    this process with ``checksums``), skipping the names in ``rejected``."""
    names = sorted((n for n in store.list_dir(store.root) if step_of(n) is not None and n not in rejected),
                   reverse=True)
    for name in names:
        manifest, problem = verify(store, store.path(name), checksums)
        if problem is None and manifest is not None:
            return name, manifest
        report(f"checkpoint {store.url_of(name)} is not valid: {problem}; trying the previous one")
    return None


def read_trainer_state(store: CheckpointStore, name: str) -> dict[str, Any]:
    return store.read_json(store.path(name, TRAINER_STATE))


def _folder_label(cfg: CheckpointConfig, store: CheckpointStore) -> str:
    """How a message names the checkpoint folder: by the setting that chose it."""
    if cfg.dir:
        return f"checkpoint.dir = '{cfg.dir}'"
    return f"the checkpoint folder {store.url} (in the run directory, as checkpoint.dir is empty)"


def _describe(error: BaseException) -> str:
    """The root cause, not DCP's wrapper with every rank's traceback."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = next(iter(error.failures.items()))
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {error}"


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True)
