"""Naming of run directories."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from meshyard.config.sections import RunConfig


def resolve_run_dir(cfg: RunConfig, job_id: str = "") -> Path:
    """``run.run_dir`` when given; ``<run.dir>/<run.name>-<job_id>`` inside a cluster job
    (the same folder after a requeue, so the run resumes); else a new
    ``<run.dir>/<run.name>-<timestamp>`` folder."""
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser().resolve()
    if job_id:
        return Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{job_id}"
    base = Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():  # two runs started within the same second
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_id_of(run_dir: Path) -> str:
    """The id of the run living in ``run_dir``: made on first use and kept there, so a
    restarted, requeued or resumed-in-place run keeps it (its checkpoints carry it)."""
    path = run_dir / "run_id"
    if path.exists():
        return path.read_text().strip()
    value = uuid.uuid4().hex[:12]
    path.write_text(value + "\n")
    return value
