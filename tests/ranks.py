"""Run a function on N gloo ranks (CPU processes) and collect what each rank returns.

``fn(rank, world_size, *args)`` runs after the process group is up (one thread per
rank, a file store in a temporary folder, so no port is needed); its return value is
saved by each rank and handed back as a list indexed by rank.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()  # no collective of another rank still in flight when the group goes
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """``fn`` must be importable (a module-level function) since ranks are spawned."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            mp.spawn(_rank_main, args=(world_size, folder, fn, args), nprocs=world_size, join=True)
        except mp.ProcessExitedException:
            # A rank that saved its result and then died in interpreter teardown (a native
            # thread of the backend aborting at exit) did its work; anything earlier fails.
            if not all((Path(folder) / f"rank{r}.pt").exists() for r in range(world_size)):
                raise
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
