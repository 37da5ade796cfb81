"""Process-group start-up and teardown, device and backend choice."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshyard.runtime.environment import ClusterEnvironment


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    store: dist.Store | None = None
    """The job's key-value store (rendezvous), also used by the hang watchdog."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    env: ClusterEnvironment | None, device_request: str, threads_per_rank: int, timeout_s: float = 600.0
) -> Runtime:
    """Join the job's process group (a one-rank group when ``env`` is None).

    On CPU each rank is limited to ``threads_per_rank`` threads: ranks sharing a machine
    otherwise oversubscribe its cores and every collective waits for the slowest one.
    """
    rank, world, local_rank = (env.rank, env.world_size, env.local_rank) if env else (0, 1, 0)
    device = choose_device(device_request, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu" and threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    store = None
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # A single process needs no rendezvous: an in-memory store suffices.
        store = dist.HashStore() if env is None else _job_store(env, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend, store=store)


_JOINS = 0


def _job_store(env: ClusterEnvironment, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this restart round.

    Under torchrun, env:// reaches the elastic agent's store, which outlives a failed
    round of workers; without a per-round prefix, restarted workers can read the dead
    round's keys (gloo's peer addresses among them) and hang connecting to them.
    Slurm and Kubeflow give only an address, so the rendezvous is over TCP there.
    """
    url = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    restart_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # A process may also join several times (a script calling run_worker twice): every
    # rank does so equally often, so a per-process count keeps those rounds apart too.
    global _JOINS
    _JOINS += 1
    return dist.PrefixStore(f"meshyard/round{restart_round}/join{_JOINS}", store)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
