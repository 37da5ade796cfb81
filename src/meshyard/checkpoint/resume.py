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
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from meshyard.checkpoint.locate import CheckpointRef, LocationError, locate, newest_valid
from meshyard.checkpoint.manifest import verify
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig
from meshyard.run_dir import RunDir
from meshyard.runtime.distributed import rank0_decides

RESUME_MODES = ("auto", "latest", "none")


class ResumeError(ValueError):
    """The requested resume source does not hold a usable checkpoint."""


# Where a run starts from: the one checkpoint type of ``locate``, under the name the
# loading code knows it by.
ResumePoint = CheckpointRef


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> str:
    return cfg.dir or str(RunDir(run_dir).checkpoints)


def find_explicit(location: str, cfg: CheckpointConfig, report: Callable[[str], None],
                  rejected: dict[str, str] | None = None) -> ResumePoint:
    """The valid checkpoint a ``--resume`` location names, found as ``meshyard ckpt`` finds
    it (``locate``: manifests and file sizes). ``rejected`` maps the locations whose
    checksums failed (see ``agree_resume_point``) to the reason."""
    try:
        return locate(location, cfg.storage_options, report=report, rejected=rejected)
    except LocationError as exc:
        raise ResumeError(f"--resume {exc}") from None


def choose_resume_point(resume: str, own_root: str, cfg: CheckpointConfig, restarted: bool,
                        report: Callable[[str], None], rejected: dict[str, str] | None = None) -> ResumePoint | None:
    """Where this run starts from, by manifests and file sizes (called on rank 0 only;
    the answer is broadcast). ``rejected``: locations whose checksums failed, skipped."""
    if resume == "none" and not restarted:
        return None
    own = newest_valid(own_root, cfg.storage_options, report, rejected)
    if own or resume in RESUME_MODES:
        return own
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
        point = rank0_decides(lambda: choose_resume_point(resume, own_root, cfg, restarted, report_once, rejected))
        if point is None or not cfg.verify_checksums:
            return point
        problem = _first_problem(_check_share(point, cfg, rank, world_size), world_size)
        if problem is None:
            return point
        if rank == 0:
            report(f"checkpoint {point.location} is not valid: {problem}")
        rejected[point.location] = problem


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


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
