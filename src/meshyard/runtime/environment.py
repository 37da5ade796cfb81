"""Where ranks come from: torchrun, Slurm, a Kubeflow pod, or nowhere (a local launch).

Detection only reads the environment the cluster gives a process; starting processes is
the launchers' job (``meshyard.launch``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class ClusterEnvironment:
    """Identity of this process in an already-started job."""

    source: str  # "torchrun", "slurm" or "kubeflow"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as ``node[03-05,9],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """The job this process already belongs to, or None when it was started by hand."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun sets the LOCAL_* and TORCHELASTIC_* variables; a Kubeflow PyTorchJob
        # pod gets only RANK/WORLD_SIZE/MASTER_* (one process per pod).
        source = "torchrun" if "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env else "kubeflow"
        return ClusterEnvironment(
            source=source,
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return ClusterEnvironment(
            source="slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
            master_addr=env.get("MASTER_ADDR") or _first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            # A port derived from the job id lets concurrent jobs on shared nodes coexist.
            master_port=int(env.get("MASTER_PORT", 20000 + job_id % 10000)),
        )
    return None
