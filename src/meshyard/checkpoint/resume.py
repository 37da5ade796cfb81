"""Deciding what a starting run resumes from, and loading it.

``--resume`` takes ``auto`` (default: this run's own newest valid checkpoint, if any),
``latest`` (continue the newest run of the same name), ``none`` (start fresh), or a path
or URL to a checkpoint, a checkpoint folder or a run directory. After an elastic restart
the run's own checkpoints always win: they are newer than anything the run started from.

Rank 0 picks the checkpoint from manifests and file sizes; the SHA-256 checks are shared
out (``agree_resume_point``): each rank reads only its part of the files, in parallel.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshyard.checkpoint.manager import find_latest_valid, read_trainer_state, step_of
from meshyard.checkpoint.manifest import MANIFEST, verify
from meshyard.checkpoint.state import SafeLoadPlanner, load_tensor_state
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig, RunConfig

RESUME_MODES = ("auto", "latest", "none")


class ResumeError(ValueError):
    """The requested resume source does not hold a usable checkpoint."""


@dataclass(frozen=True)
class ResumePoint:
    root: str  # checkpoint root URL or path
    name: str  # step-NNNNNNNN
    manifest: dict[str, Any]

    @property
    def location(self) -> str:
        return posixpath.join(self.root, self.name) if "://" not in self.root else f"{self.root.rstrip('/')}/{self.name}"


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> str:
    return cfg.dir or str(run_dir / "checkpoints")


def latest_run_dir(cfg: RunConfig) -> Path | None:
    """The newest run directory named ``<run.name>-*`` (or ``<run.name>``) that has checkpoints."""
    base = Path(cfg.dir).expanduser().resolve()
    candidates = [p for p in base.glob(f"{cfg.name}*") if (p / "checkpoints").is_dir()
                  and (p.name == cfg.name or p.name.startswith(f"{cfg.name}-"))]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def find_explicit(location: str, cfg: CheckpointConfig, report: Callable[[str], None],
                  rejected: dict[str, str] | None = None) -> ResumePoint:
    """A checkpoint named by the user: a checkpoint, a folder of them, or a run directory.
    Manifests and file sizes are checked here; ``rejected`` maps the locations whose
    checksums failed (see ``agree_resume_point``) to the reason."""
    options, rejected = cfg.storage_options, rejected or {}
    store = CheckpointStore(location, options)
    if store.exists(store.path(MANIFEST)):
        parent, name = location.rstrip("/").rsplit("/", 1) if "/" in location.rstrip("/") else (".", location)
        manifest, problem = verify(store, store.root, checksums=False)
        problem = problem or rejected.get(ResumePoint(parent, name, {}).location)
        if problem or manifest is None:
            raise ResumeError(f"--resume {location}: the checkpoint is not valid ({problem})")
        return ResumePoint(parent, name, manifest)
    for root in (location, posixpath.join(location, "checkpoints") if "://" not in location
                 else f"{location.rstrip('/')}/checkpoints"):
        store = CheckpointStore(root, options)
        if any(step_of(n) is not None for n in store.list_dir(store.root)):
            found = find_latest_valid(store, False, report, _names_under(root, rejected))
            if found:
                return ResumePoint(root, found[0], found[1])
            raise ResumeError(f"--resume {location}: no valid checkpoint there (see the messages above)")
    raise ResumeError(f"--resume {location}: not a checkpoint, a checkpoint folder or a run directory")


def _names_under(root: str, rejected: dict[str, str]) -> set[str]:
    """Checkpoint names directly under ``root`` among the ``rejected`` locations."""
    names = {location.rstrip("/").rsplit("/", 1)[-1] for location in rejected}
    return {name for name in names if ResumePoint(root, name, {}).location in rejected}


def choose_resume_point(resume: str, own_root: str, cfg: CheckpointConfig, restarted: bool,
                        report: Callable[[str], None], rejected: dict[str, str] | None = None) -> ResumePoint | None:
    """Where this run starts from, by manifests and file sizes (called on rank 0 only;
    the answer is broadcast). ``rejected``: locations whose checksums failed, skipped."""
    if resume == "none" and not restarted:
        return None
    rejected = rejected or {}
    own = find_latest_valid(CheckpointStore(own_root, cfg.storage_options), False, report,
                            _names_under(own_root, rejected))
    if own:
        return ResumePoint(own_root, own[0], own[1])
    if resume in RESUME_MODES:
        return None
    return find_explicit(resume, cfg, report, rejected)


def agree_resume_point(resume: str, own_root: str, cfg: CheckpointConfig, restarted: bool,
                       report: Callable[[str], None], rank: int, world_size: int) -> ResumePoint | None:
    """Where every rank starts from, checked by all ranks together.

    Rank 0 chooses (``choose_resume_point``) and tells the others; then every rank checks
    the SHA-256 of its share of the files (on the same world size, the files it wrote), so
    each file is read once, in parallel, and the collective that collects the verdicts
    waits for a share, not for one rank reading everything. A checkpoint that fails on any
    rank is reported by rank 0 and the next older one is tried."""
    rejected: dict[str, str] = {}
    seen: set[str] = set()

    def report_once(message: str) -> None:  # each round re-lists the checkpoints
        if message not in seen:
            seen.add(message)
            report(message)

    while True:
        point = _rank0_decides(lambda: choose_resume_point(resume, own_root, cfg, restarted, report_once, rejected),
                               rank, world_size)
        if point is None or not cfg.verify_checksums:
            return point
        problem = _first_problem(_check_share(point, cfg, rank, world_size), world_size)
        if problem is None:
            return point
        if rank == 0:
            report(f"checkpoint {point.location} is not valid: {problem}")
        rejected[point.location] = problem


def _rank0_decides(decide: Callable[[], Any], rank: int, world_size: int) -> Any:
    """Rank 0's answer on every rank; an exception raised by rank 0's ``decide`` is raised
    on every rank (instead of the others waiting for an answer that never comes)."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = decide()
        except Exception as exc:
            box[0] = exc
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _check_share(point: ResumePoint, cfg: CheckpointConfig, rank: int, world_size: int) -> str | None:
    """This rank's verdict on its share of the files; never raises, so every rank reaches
    the collective that gathers the verdicts."""
    try:
        store = CheckpointStore(point.root, cfg.storage_options)
        return verify(store, store.path(point.name), True, rank, world_size)[1]
    except Exception as exc:
        return f"reading it on rank {rank} failed ({type(exc).__name__}: {exc})"


def _first_problem(problem: str | None, world_size: int) -> str | None:
    problems = [problem]
    if world_size > 1:
        problems = [None] * world_size
        dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def load_resume_point(point: ResumePoint, cfg: CheckpointConfig, trainer: Any, rank: int) -> bool:
    """Load model, optimizer, extra state and trainer state into ``trainer``; returns
    whether this rank's RNG state was restored (only when a rank of that number saved one)."""
    store = CheckpointStore(point.root, cfg.storage_options)
    location = store.path(point.name)
    saved_keys = set(store.dcp_reader(location).read_metadata().state_dict_metadata)
    restored_rng = load_tensor_state(
        lambda state: dcp.load(state, storage_reader=store.dcp_reader(location), planner=SafeLoadPlanner()),
        trainer.model, trainer.optimizer, rank, saved_keys, trainer.extra_state,
    )
    trainer.load_trainer_state(read_trainer_state(store, point.name))
    return restored_rng


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
