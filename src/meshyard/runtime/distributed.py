"""Process-group start-up and teardown, device and backend choice."""

from __future__ import annotations

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
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if env is None:
            # A single process needs no rendezvous: an in-memory store suffices.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            # Under torchrun, env:// reuses the elastic agent's store; Slurm and Kubeflow
            # give only an address, so rendezvous there over TCP.
            init_method = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
