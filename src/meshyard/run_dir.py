"""Naming of run directories, and the id of the run that lives in one.

A run directory is named after the job, never after the clock, whenever the environment
names a job (``runtime.environment.job_identity``): a restarted, requeued or re-launched
job then opens the same folder on every node and finds its checkpoints there.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from pathlib import Path
from typing import Mapping

from meshyard.config.sections import RunConfig
from meshyard.runtime.environment import detect_environment, generated_rendezvous_id, job_identity, rendezvous_id

RUN_ID_FILE = "run_id"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def resolve_run_dir(cfg: RunConfig, job_id: str = "") -> Path:
    """``run.run_dir`` when given; ``<run.dir>/<run.name>-<job_id>`` for a job with an id
    (the same folder after a restart or a requeue, so the run resumes); else a new
    ``<run.dir>/<run.name>-<timestamp>`` folder."""
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser().resolve()
    if job_id:
        # An id may hold characters a folder name should not ('/', spaces).
        return Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{_UNSAFE.sub('-', job_id)}"
    base = Path(cfg.dir).expanduser().resolve() / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():  # two runs started within the same second
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_id_of(run_dir: Path, job_id: str = "") -> str:
    """The id of the run living in ``run_dir`` (its checkpoints carry it): the one kept in
    the folder when there is one, so a run continued in place keeps its id; else, for a
    job with an id, one derived from the job and the folder's name, which every node
    derives alike even where nodes do not share the run directory; else a random one.
    A new id is kept in the folder. Call it on one rank (rank 0) and hand the answer on."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    value = derived_run_id(job_id, run_dir.name) if job_id else uuid.uuid4().hex[:12]
    path.write_text(value + "\n")
    return value


def derived_run_id(job_id: str, run_name: str) -> str:
    """A run id that depends only on the job and the run directory's name (12 hex digits,
    like a random one: it goes into file names)."""
    return hashlib.sha256(f"{job_id}\n{run_name}".encode()).hexdigest()[:12]


def restart_advice(cfg: RunConfig, env: Mapping[str, str]) -> str:
    """One line for a job started by another launcher whose run directory a restart would
    not find again (no job id to name it by, or one torchrun made up for this start);
    "" when it would be found, or ``run.run_dir`` names it."""
    cluster = detect_environment(env)
    if cfg.run_dir or cluster is None:
        return ""
    fix = "set run.run_dir, or continue the newest run with --resume latest"
    if cluster.source == "torchrun":
        fix = "pass the same --rdzv-id to torchrun on every start, " + fix
    if not job_identity(env):
        why = "torchrun was given no --rdzv-id" if cluster.source == "torchrun" else "the environment names no job"
        return (f"meshyard: this job has no id that survives a restart ({why}), so its run directory is named "
                f"by the time it started and a restarted job starts again from step 0; {fix}")
    if generated_rendezvous_id(env) and job_identity(env) == rendezvous_id(env):
        return (f"meshyard: torchrun made up the rendezvous id {rendezvous_id(env)} for this start (--standalone, "
                f"or one node without --rdzv-id), so starting the command again opens a new run directory and "
                f"starts from step 0; {fix}")
    return ""
