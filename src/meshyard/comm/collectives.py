"""Timing collectives the way nccl-tests does, from inside a running process group.

For a message of S bytes taking t seconds: algorithm bandwidth algbw = S / t, and bus
bandwidth busbw = algbw x factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather and reduce-scatter, 1 for broadcast; busbw is what each rank's link carried,
comparable across rank counts and with the link's peak. S is the full tensor: the
all-reduce buffer, the all-gather output (each rank gives S/n), the reduce-scatter
input (each rank keeps S/n), the broadcast buffer. The time is the mean over
``iters`` calls after ``warmup`` calls, taken as the slowest rank's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshyard.comm.accounting import BUS_FACTORS

OPERATIONS = tuple(BUS_FACTORS)

# all_gather_single / reduce_scatter_single are the current names; older torch has
# only the *_tensor ones (deprecated since).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveTiming:
    """One (operation, size) measurement."""

    op: str
    size_bytes: int
    count: int
    dtype: str
    world_size: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def _make_call(op: str, numel: int, world: int, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """The collective for a message of ``numel`` elements, with its buffers allocated once."""
    if op == "all_reduce":
        buffer = torch.ones(numel, device=device, dtype=dtype)
        return lambda: dist.all_reduce(buffer)
    if op == "broadcast":
        buffer = torch.ones(numel, device=device, dtype=dtype)
        return lambda: dist.broadcast(buffer, src=0)
    full = torch.ones(numel, device=device, dtype=dtype)
    share = torch.ones(numel // world, device=device, dtype=dtype)
    if op == "all_gather":
        return lambda: _all_gather(full, share)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter(share, full)
    raise ValueError(f"unknown collective '{op}'; known: {', '.join(OPERATIONS)}")


def time_collective(op: str, size_bytes: int, iters: int = 20, warmup: int = 5,
                    device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> CollectiveTiming:
    """Measure ``op`` on the default process group with a message of about ``size_bytes``
    (rounded down to whole elements, and to a multiple of the world size)."""
    device = device or torch.device("cpu")
    world = dist.get_world_size()
    item = torch.empty((), dtype=dtype).element_size()
    numel = max(world, size_bytes // item // world * world)
    call = _make_call(op, numel, world, device, dtype)
    for _ in range(warmup):
        call()
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = elapsed.item()
    size = numel * item
    algbw = size / seconds / 1e9
    return CollectiveTiming(op=op, size_bytes=size, count=numel, dtype=str(dtype).removeprefix("torch."),
                            world_size=world, time_us=seconds * 1e6, algbw_gbps=algbw,
                            busbw_gbps=algbw * BUS_FACTORS[op](world))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sweep(ops: list[str], sizes: list[int], iters: int, warmup: int,
          device: torch.device | None = None) -> list[dict[str, Any]]:
    """Every operation at every size, as plain records (the same on every rank)."""
    return [asdict(time_collective(op, size, iters, warmup, device)) for op in ops for size in sizes]
