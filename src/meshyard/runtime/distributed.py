"""Process-group start-up and teardown, device and backend choice."""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshyard.config.load import ConfigError
from meshyard.runtime.devices import process_group_backend, shared_gpu_groups, sharing_message
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
    """This rank's device: CUDA device ``local_rank`` modulo the visible ones, else the CPU.

    The modulo keeps per-task GPU binding working (Slurm ``--gpus-per-task=1`` shows each
    task one GPU whatever its local rank); ranks that land on one GPU this way are found
    by ``init_distributed``, which compares the GPUs' UUIDs across the job.
    """
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    env: ClusterEnvironment | None, device_request: str, threads_per_rank: int, timeout_s: float = 600.0,
    share_gpus: bool = False,
) -> Runtime:
    """Join the job's process group (a one-rank group when ``env`` is None).

    On CPU each rank is limited to ``threads_per_rank`` threads: ranks sharing a machine
    otherwise oversubscribe its cores and every collective waits for the slowest one.
    Ranks that would share a GPU raise ``ConfigError`` unless ``share_gpus`` allows it.
    """
    rank, world, local_rank = (env.rank, env.world_size, env.local_rank) if env else (0, 1, 0)
    device = choose_device(device_request, local_rank)
    if device.type == "cpu" and threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    if dist.is_initialized():
        return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device,
                       backend=str(dist.get_backend()))
    timeout = timedelta(seconds=timeout_s)
    # A single process needs no rendezvous: an in-memory store suffices.
    store = dist.HashStore() if env is None else _job_store(env, timeout)
    shared = False
    if device.type == "cuda" and world > 1:
        gpu = str(torch.cuda.get_device_properties(device).uuid)
        shared = ranks_share_gpus(store, rank, world, gpu, share_gpus)
    backend = process_group_backend(device.type, shared)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout,
        # Binding the device starts NCCL at once; gloo alone (shared GPUs) needs no binding.
        device_id=device if "nccl" in backend else None,
    )
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend, store=store)


def ranks_share_gpus(store: dist.Store, rank: int, world: int, gpu_uuid: str, allowed: bool) -> bool:
    """Whether two ranks of the job compute on one GPU, given this rank's GPU UUID
    (raises ``ConfigError`` unless ``allowed``).

    Every rank publishes its GPU's UUID in the job store before the process group starts,
    so every rank reaches the same verdict, and before NCCL would refuse the job with a
    message that names no fix. UUIDs, not indices: CUDA_VISIBLE_DEVICES and scheduler
    binding renumber devices per process.
    """
    store.set(f"gpu_uuid/{rank}", gpu_uuid)
    uuids = [store.get(f"gpu_uuid/{other}").decode() for other in range(world)]
    groups = shared_gpu_groups(uuids)
    if groups and not allowed:
        raise ConfigError([sharing_message(groups)], "launch")
    return bool(groups)


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
    # Only a store the agent shares outlives a round; a store made for the round (rank 0
    # serves it, as in a multi-node meshyard job) starts empty. There the round is not
    # named by the restart count, which differs between nodes (a node started again
    # after a loss counts from 0 while the others count on), so the ranks would wait
    # for each other under different names.
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    restart_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "fresh"
    # A process may also join several times (a script calling run_worker twice): every
    # rank does so equally often, so a per-process count keeps those rounds apart too.
    global _JOINS
    _JOINS += 1
    return dist.PrefixStore(f"meshyard/round{restart_round}/join{_JOINS}", store)


def shutdown_distributed(settle_s: float = 0.5) -> None:
    """Destroy every process group so that each is freed on this thread.

    A comm hook's callbacks (PowerSGD's) hold their process group and run on the group's
    gloo worker threads, which drop them a moment after the step's future completes. If that
    drop frees the group, its destructor joins the very thread it runs on: std::terminate
    ("Resource deadlock avoided") kills a process that trains twice. So the groups are held
    here until, for at most ``settle_s``, only these references remain; the last release is
    then this thread's."""
    if not dist.is_initialized():
        return
    groups = list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))
    dist.destroy_process_group()
    gc.collect()  # DDP modules and hook states in reference cycles hold the groups too
    deadline = time.monotonic() + settle_s
    # References counted: the list, the loop variable and getrefcount's argument.
    while any(sys.getrefcount(group) > 3 for group in groups) and time.monotonic() < deadline:
        time.sleep(0.001)
    del groups


def rank0_decides(decide: Callable[[], Any]) -> Any:
    """Rank 0's answer to ``decide()``, on every rank (a broadcast). If rank 0's decision
    raised, every rank raises it, instead of the others waiting forever for an answer."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except Exception as exc:  # handed to every rank below
            box[0] = exc
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]
