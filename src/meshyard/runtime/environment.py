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
    # sbatch gives the batch script itself SLURM_PROCID=0 and the job's SLURM_NTASKS, but
    # only srun tasks have a SLURM_STEP_ID: a batch step is not a rank (it launches them).
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
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


# What no launcher means as an id: torchrun's value when no --rdzv-id was given.
_NO_ID = ("", "none")
# What torchrun makes up itself (--standalone, or one node without --rdzv-id): a uuid4.
_GENERATED_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
# Kubeflow names the rendezvous host after the job, and keeps the name when it restarts a
# pod: "<job>-master-0" (PyTorchJob), "<job>-worker-0:<port>" (elastic PyTorchJob),
# "<job>-node-0-0.<job>" (TrainJob of Kubeflow Trainer).
_JOB = r"(?P<job>[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)"
_KUBEFLOW_HOSTS = (
    (("MASTER_ADDR", "PET_MASTER_ADDR"), re.compile(rf"^{_JOB}-master-0(?:\..*)?$")),
    (("PET_RDZV_ENDPOINT",), re.compile(rf"^{_JOB}-worker-0(?:\.[^:]*)?:\d+$")),
    (("PET_MASTER_ADDR", "MASTER_ADDR"), re.compile(rf"^{_JOB}-node-0-0\.(?P=job)(?:\..*)?$")),
)


def job_identity(env: Mapping[str, str] | None = None) -> str:
    """The id of the job this process belongs to that stays the same when the job restarts
    or is requeued, so its run directory and checkpoints are found again; "" when the
    environment names none (a local launch, or torchrun's static rendezvous).

    In order: the Slurm job (``slurm<id>``, an array task ``slurm<array id>_<task id>``),
    because a requeue keeps it while a rendezvous id inside it is often made up per launch;
    the rendezvous id (``TORCHELASTIC_RUN_ID`` that torchrun's ``--rdzv-id`` sets, or
    Kubeflow's ``PET_RDZV_ID``); the name of a Kubeflow job, read from the rendezvous host
    that Kubeflow names after it (in a Kubernetes pod only).
    """
    env = os.environ if env is None else env
    return _slurm_job(env) or rendezvous_id(env) or _kubeflow_job(env)


def rendezvous_id(env: Mapping[str, str]) -> str:
    """torchrun's rendezvous id (``--rdzv-id``, or ``PET_RDZV_ID`` that it reads), "" when none was given."""
    for key in ("TORCHELASTIC_RUN_ID", "PET_RDZV_ID"):
        if env.get(key, "") not in _NO_ID:
            return env[key]
    return ""


def generated_rendezvous_id(env: Mapping[str, str]) -> bool:
    """Whether the rendezvous id looks made up by torchrun (a new one on every start)."""
    return bool(_GENERATED_ID.match(rendezvous_id(env)))


def _slurm_job(env: Mapping[str, str]) -> str:
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return f"slurm{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else ""


def _kubeflow_job(env: Mapping[str, str]) -> str:
    if not env.get("KUBERNETES_SERVICE_HOST"):  # the same host names elsewhere mean nothing
        return ""
    for keys, pattern in _KUBEFLOW_HOSTS:
        for key in keys:
            match = pattern.match(env.get(key, ""))
            if match:
                return match.group("job")
    return ""
