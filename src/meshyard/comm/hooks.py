"""The compression object every data-parallel run gets, and the casting methods.

A compression object is three things at once: the *state* of a DDP communication hook
(DDP calls ``hook(bucket)`` through ``register_comm_hook``), the byte accounting of
each step (``take_step_stats``), and a checkpointable value (``state_dict`` /
``load_state_dict`` with plain tensors and numbers). Every method syncs plain
all-reduce for its first ``warmup_steps`` steps: early gradients are large and change
fast, which is where compression costs the most accuracy.

Runs without a DDP all-reduce get ``NoCompression``, a null object with the same
methods, so the trainer never branches on the layout.
"""

from __future__ import annotations

from typing import Callable, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from meshyard.comm.accounting import ByteCounter


def _dispatch(state, bucket):
    # No annotations on purpose: DDP's hook check compares them with the real
    # GradBucket/Future types, and postponed (string) annotations would fail it.
    return state.hook(bucket)


class GradientCompression:
    """Base class: plain averaged all-reduce, counted; subclasses override ``compress``."""

    method: str = "none"

    def __init__(self, process_group: dist.ProcessGroup | None = None, warmup_steps: int = 0) -> None:
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self._iteration = 0
        self._names: dict[int, str] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        # Public so a measurement can count for another world size (see ByteCounter).
        self.counter = ByteCounter()
        self._kept: dict[str, torch.Tensor] = {}  # the tensors state_dict returns, by key (see _kept_buffer)

    # -- wiring ---------------------------------------------------------------------

    def register(self, ddp: DistributedDataParallel, wrap: Callable[[Callable], Callable] | None = None) -> None:
        """Install this object as ``ddp``'s communication hook (once per DDP module);
        ``wrap`` decorates the hook (step-time measurement marks bucket launches)."""
        for name, param in ddp.module.named_parameters():
            if param.requires_grad:  # only these are in DDP's buckets
                self._names[id(param)] = name
                self._shapes[name] = param.shape
                self._params[name] = param
        self.counter.world_size = self.group().size()
        ddp.register_comm_hook(self, wrap(_dispatch) if wrap else _dispatch)

    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def bucket_names(self, bucket: dist.GradBucket) -> list[str]:
        """Names of the parameters in ``bucket``, in the order of its flat buffer."""
        return [self._names[id(p)] for p in bucket.parameters()]

    @property
    def iteration(self) -> int:
        """Gradient syncs done so far (one per optimizer step; accumulation steps do not sync)."""
        return self._iteration

    def _set_iteration(self, value: int) -> None:
        self._iteration = value

    @property
    def compressing(self) -> bool:
        return self.iteration >= self.warmup_steps

    # -- the hook -------------------------------------------------------------------

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Sync one bucket: plain all-reduce during warm-up, ``compress`` after it."""
        if self.compressing:
            future = self.compress(bucket)
        else:
            future = self.allreduce(bucket)
        if bucket.is_last():
            self._iteration += 1
        return future

    def allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """PyTorch's own averaging all-reduce, counted."""
        buffer = bucket.buffer()
        size = buffer.numel() * buffer.element_size()
        self.counter.add("all_reduce", size, size)
        return default_hooks.allreduce_hook(self.process_group, bucket)

    def compress(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return self.allreduce(bucket)

    # -- records --------------------------------------------------------------------

    def take_step_stats(self) -> dict[str, int | float]:
        """Bytes this rank contributed since the last call: ``comm_bytes``,
        ``comm_bytes_uncompressed``, ``compression_ratio``, ``comm_wire_bytes``;
        the counts start again from zero."""
        return self.counter.take()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: plain numbers and tensors. It differs
        between ranks for methods with error feedback, so save it per rank.

        Once registered, the keys and tensor shapes are the same from the first step on
        (zeros stand for state not built yet), so a fresh object's ``state_dict()`` is
        the template that ``torch.distributed.checkpoint`` loads into in place."""
        return {"method": self.method, "iteration": self.iteration}

    def _kept_buffer(self, key: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of ``numel`` entries in ``like``'s dtype and device, the same one
        under ``key`` from one ``state_dict`` to the next. Subclasses copy their state into
        these rather than returning fresh copies: an async save stages each storage into a
        host buffer it keeps for that storage, so a new storage per save would have its
        buffer allocated and pinned again every time. A copy still, never the live state,
        which the next step's hook changes while the save may still be copying it."""
        kept = self._kept.get(key)
        if kept is None or kept.numel() != numel or kept.dtype != like.dtype or kept.device != like.device:
            kept = self._kept[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return kept

    def _kept_copy(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """``value``, flattened, copied into the tensor kept under ``key``."""
        return self._kept_buffer(key, value.numel(), value).copy_(value.detach().reshape(-1))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method", self.method) != self.method:
            raise ValueError(
                f"compression state was saved by method '{state['method']}', this run uses '{self.method}'"
            )
        self._set_iteration(int(state["iteration"]))


class NoCompression(GradientCompression):
    """No hook: DDP's built-in all-reduce (or no gradient sync at all) stays untouched.

    ``bytes_per_step`` is what DDP all-reduces each step (every gradient once), 0 for a
    single process, and None where gradients are not all-reduced by DDP (FSDP's
    reduce-scatters are not counted here), in which case no figures are reported.
    """

    def __init__(self, bytes_per_step: int | None = None, world_size: int = 1) -> None:
        super().__init__()
        self.bytes_per_step = bytes_per_step
        self.counter.world_size = world_size

    def register(self, ddp: DistributedDataParallel, wrap: Callable[[Callable], Callable] | None = None) -> None:
        pass

    def take_step_stats(self) -> dict[str, int | float]:
        if self.bytes_per_step is None:
            return {}
        # Every step syncs every gradient once, so the count is known without a hook,
        # which keeps DDP's faster built-in all-reduce path.
        self.counter.add("all_reduce", self.bytes_per_step, self.bytes_per_step)
        return self.counter.take()


def bf16_cast_hook(process_group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a bucket in bfloat16, averaged, and write it back in the gradient dtype.

    The twin of PyTorch's ``fp16_compress_hook``. PyTorch's own ``bf16_compress_hook``
    is refused by DDP on gloo (by the hook's name), though gloo reduces bf16 fine.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(future: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


class CastCompression(GradientCompression):
    """fp16 or bf16 all-reduce: half the bytes, no state beyond the step count.

    fp16 keeps 3 more mantissa bits but overflows past 65504 (gradients are divided by
    the world size before the cast to keep sums in range); bf16 has fp32's range.
    """

    def __init__(self, dtype: torch.dtype, process_group: dist.ProcessGroup | None = None,
                 warmup_steps: int = 0) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast compression takes float16 or bfloat16, not {dtype}")
        super().__init__(process_group, warmup_steps)
        self.dtype = dtype
        self.method = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        cast_bytes = buffer.numel() * torch.empty((), dtype=self.dtype).element_size()
        self.counter.add("all_reduce", cast_bytes, buffer.numel() * buffer.element_size())
        if self.dtype == torch.float16:
            return default_hooks.fp16_compress_hook(self.process_group, bucket)
        return bf16_cast_hook(self.process_group, bucket)
