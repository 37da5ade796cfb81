"""Deciding what a starting run resumes from, and loading it.

``--resume`` takes ``auto`` (default: this run's own newest valid checkpoint, if any),
``latest`` (continue the newest run of the same name), ``none`` (start fresh), or a path
or URL to a checkpoint, a checkpoint folder or a run directory. After an elastic restart
the run's own checkpoints always win: they are newer than anything the run started from.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed.checkpoint as dcp

from meshyard.checkpoint.manager import find_latest_valid, read_trainer_state, step_of
from meshyard.checkpoint.manifest import MANIFEST, verify
from meshyard.checkpoint.state import load_tensor_state
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


def find_explicit(location: str, cfg: CheckpointConfig, report: Callable[[str], None]) -> ResumePoint:
    """A checkpoint named by the user: a checkpoint, a folder of them, or a run directory."""
    options = cfg.storage_options
    store = CheckpointStore(location, options)
    if store.exists(store.path(MANIFEST)):
        parent, name = location.rstrip("/").rsplit("/", 1) if "/" in location.rstrip("/") else (".", location)
        manifest, problem = verify(store, store.root, cfg.verify_checksums)
        if problem or manifest is None:
            raise ResumeError(f"--resume {location}: the checkpoint is not valid ({problem})")
        return ResumePoint(parent, name, manifest)
    for root in (location, posixpath.join(location, "checkpoints") if "://" not in location
                 else f"{location.rstrip('/')}/checkpoints"):
        store = CheckpointStore(root, options)
        if any(step_of(n) is not None for n in store.list_dir(store.root)):
            found = find_latest_valid(store, cfg.verify_checksums, report)
            if found:
                return ResumePoint(root, found[0], found[1])
            raise ResumeError(f"--resume {location}: no valid checkpoint there (see the messages above)")
    raise ResumeError(f"--resume {location}: not a checkpoint, a checkpoint folder or a run directory")


def choose_resume_point(resume: str, own_root: str, cfg: CheckpointConfig, restarted: bool,
                        report: Callable[[str], None]) -> ResumePoint | None:
    """Where this run starts from (called on rank 0 only; the answer is broadcast)."""
    if resume == "none" and not restarted:
        return None
    own = find_latest_valid(CheckpointStore(own_root, cfg.storage_options), cfg.verify_checksums, report)
    if own:
        return ResumePoint(own_root, own[0], own[1])
    if resume in RESUME_MODES:
        return None
    return find_explicit(resume, cfg, report)


def load_resume_point(point: ResumePoint, cfg: CheckpointConfig, trainer: Any, rank: int) -> bool:
    """Load model, optimizer, extra state and trainer state into ``trainer``; returns
    whether this rank's RNG state was restored (only when a rank of that number saved one)."""
    store = CheckpointStore(point.root, cfg.storage_options)
    location = store.path(point.name)
    saved_keys = set(store.dcp_reader(location).read_metadata().state_dict_metadata)
    restored_rng = load_tensor_state(
        lambda state: dcp.load(state, storage_reader=store.dcp_reader(location)),
        trainer.model, trainer.optimizer, rank, saved_keys, trainer.extra_state,
    )
    trainer.load_trainer_state(read_trainer_state(store, point.name))
    return restored_rng


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
