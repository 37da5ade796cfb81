"""The job this process belongs to, and the run directory named after it: found once.

``meshyard.run`` (``api``) and every rank (``worker``) ask here, by one rule: the
environment is read once per process (``Job.detect``) and handed on, and the run
directory is named by ``Job.run_dir`` wherever it is decided (the launcher, or rank 0 of a
job another launcher started).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from meshyard.config.sections import RunConfig
from meshyard.run_dir import RunDir, resolve_run_dir
from meshyard.runtime.environment import (ClusterEnvironment, detect_environment, generated_rendezvous_id,
                                          job_identity, rendezvous_id)


@dataclass(frozen=True)
class Job:
    """What the environment says about this process's job."""

    environment: ClusterEnvironment | None
    """The job this process already is a rank of (torchrun, Slurm, Kubeflow); None when started by hand."""
    id: str
    """The id that survives restarts and requeues (``environment.job_identity``); "" when none."""
    rendezvous: str = ""
    """torchrun's rendezvous id, "" when none was given."""
    made_up_rendezvous: bool = False
    """Whether torchrun made that id up for this start (a new one on every start)."""

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> Job:
        """The job of the environment ``env`` (default: this process's)."""
        env = os.environ if env is None else env
        return cls(detect_environment(env), job_identity(env), rendezvous_id(env), generated_rendezvous_id(env))

    def named(self, rdzv_id: str) -> Job:
        """This job under ``run.rdzv_id`` when one is given: how meshyard's own launcher
        names the jobs it starts (every node and every restart share it)."""
        return dataclasses.replace(self, id=rdzv_id) if rdzv_id else self

    def run_dir(self, cfg: RunConfig, given: str | Path | None = None) -> RunDir:
        """The run directory: ``given`` (by meshyard's launcher), else ``run.run_dir``, else
        one named after this job (``run_dir.resolve_run_dir``). Not created here."""
        return RunDir(given) if given else RunDir(resolve_run_dir(cfg, self.id))

    def restart_advice(self, cfg: RunConfig) -> str:
        """One line for a job started by another launcher whose run directory a restart
        would not find again (no job id to name it by, or one torchrun made up for this
        start); "" when it would be found, or ``run.run_dir`` names it."""
        cluster = self.environment
        if cfg.run_dir or cluster is None:
            return ""
        fix = "set run.run_dir, or continue the newest run with --resume latest"
        if cluster.source == "torchrun":
            fix = "pass the same --rdzv-id to torchrun on every start, " + fix
        if not self.id:
            why = "torchrun was given no --rdzv-id" if cluster.source == "torchrun" else "the environment names no job"
            return (f"meshyard: this job has no id that survives a restart ({why}), so its run directory is named "
                    f"by the time it started and a restarted job starts again from step 0; {fix}")
        if self.made_up_rendezvous and self.id == self.rendezvous:
            return (f"meshyard: torchrun made up the rendezvous id {self.rendezvous} for this start (--standalone, "
                    f"or one node without --rdzv-id), so starting the command again opens a new run directory and "
                    f"starts from step 0; {fix}")
        return ""
