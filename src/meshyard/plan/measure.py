"""Measured peak memory of real training steps on CPU, to check the estimator against.

How memory is measured: each rank runs its steps under ``torch.profiler`` with
``profile_memory=True``. Every allocation and free made through c10's CPU allocator is
reported with the allocator's running total of live bytes (``total_allocated``); the
peak is the largest total seen minus the total before the model was built. Inputs,
parameters, gradients, optimizer states, activations and the tensors collectives
allocate are all counted; memory that gloo or the C++ runtime allocate outside c10
(and Python objects) is not, which matches what the estimator models on a GPU, where
NCCL's buffers are also outside the caching allocator.

The steps are meshyard's: the model from ``meshyard.models.gpt``, wrapped by
``meshyard.parallel.data_parallel`` (``apply_ddp``: DDP with gradients as bucket views;
``apply_fsdp``: FSDP2 ``fully_shard`` per block then the root), AdamW (or ZeRO-1's
sharded AdamW) from ``meshyard.train.optim.build_optimizer``, the trainer's fp32
next-token loss, and ``zero_grad(set_to_none=True)``. Tensor parallelism uses torch's
``parallelize_module`` with a Megatron-style plan and checkpointing torch's
``checkpoint_wrapper`` per block, applied in meshyard's order (TP, checkpointing, then
data parallelism). Ranks are ``torch.multiprocessing`` processes on gloo, one thread
each.
"""

from __future__ import annotations

import gc
import json
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.plan.layout import PRECISIONS, Layout, make_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_STRATEGY_TO_LAYOUT = {
    "none": "none", "ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp3", "fsdp-zero2": "fsdp2", "tp": "none",
}


@dataclass(frozen=True)
class MemoryProbe:
    """One measured configuration: a GPT preset, a strategy and a batch shape."""

    preset: str = "gpt-tiny"
    strategy: str = "none"
    """'none', 'ddp', 'zero1', 'fsdp' (ZeRO-3), 'fsdp-zero2' (reshard_after_forward=False)
    or 'tp' (tensor parallel over all ranks)."""
    world_size: int = 1
    micro_batch: int = 8
    seq_len: int = 128
    vocab_size: int = 256
    steps: int = 2
    checkpoint: bool = False
    """Recompute every block in backward (full activation checkpointing)."""

    def shape(self) -> GPTShape:
        return GPTShape(vocab_size=self.vocab_size, context_length=self.seq_len, **GPT_PRESETS[self.preset])

    def layout(self) -> Layout:
        """The layout the estimator should be given for this probe (fp32, CPU AdamW)."""
        tp = self.world_size if self.strategy == "tp" else 1
        # The TP probe keeps embeddings and head replicated and has no sequence parallelism.
        return make_layout(_STRATEGY_TO_LAYOUT[self.strategy], self.world_size, tp=tp,
                           micro_batch=self.micro_batch, seq_len=self.seq_len, precision=PRECISIONS["fp32"],
                           ac="full" if self.checkpoint else "none", sequence_parallel=False,
                           vocab_parallel=False)

    def label(self) -> str:
        return f"{self.preset} {self.strategy}{' +ac' if self.checkpoint else ''} x{self.world_size}"


@dataclass(frozen=True)
class MeasuredPeak:
    """Peak live bytes of one rank, and what was alive when its steps ended."""

    rank: int
    peak_bytes: int
    final_bytes: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(time, bytes allocated (negative: freed), live bytes after) of every CPU allocator
    event the profiler saw, in time order.

    Read from the profiler's event tree: the public ``events()`` folds allocations into
    the operators that made them and loses their order, which the peak needs.
    """
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        stack.extend(node.children)
    return sorted(events)


def _apply_tp(model: GPT, mesh: "DeviceMesh") -> GPT:
    """Megatron-style plan: qkv and fc column-wise, both projections row-wise.

    A memory probe only: sharding the fused qkv weight by rows mixes q, k and v heads
    across ranks, which changes the numbers computed but not the tensors' sizes.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _parallelize(model: GPT, probe: MemoryProbe) -> torch.nn.Module:
    """Wrap ``model`` the way meshyard does, in its order: TP, checkpointing, then DDP/FSDP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp

    mesh = init_device_mesh("cpu", (probe.world_size,)) if probe.world_size > 1 else None
    if probe.strategy == "tp":
        model = _apply_tp(model, mesh)
    if probe.checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if mesh is None or probe.strategy in ("none", "tp"):
        return model
    if probe.strategy in ("ddp", "zero1"):
        return apply_ddp(model, mesh)
    return apply_fsdp(model, mesh, reshard_after_forward=probe.strategy == "fsdp")


def _run_steps(probe: MemoryProbe, rank: int) -> MeasuredPeak:
    from meshyard.config.sections import OptimConfig
    from meshyard.train.optim import build_optimizer

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, probe.vocab_size, (probe.micro_batch, probe.seq_len + 1), generator=generator)
               for _ in range(probe.steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        marker = torch.empty(1)  # first event: the allocator's total before the model exists
        model = _parallelize(GPT(probe.shape()), probe)
        shard_group = dist.group.WORLD if probe.strategy == "zero1" else None
        optimizer = build_optimizer(model, OptimConfig(), 1e-3, shard_group=shard_group)
        for tokens in batches:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            logits = model(inputs)
            # The trainer's loss: fp32 cross-entropy over the flattened positions.
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            del logits
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del marker
    events = _allocator_events(prof)
    _, marker_bytes, after_marker = events[0]
    baseline = after_marker - marker_bytes
    peak = max(total for _, _, total in events) - baseline
    return MeasuredPeak(rank=rank, peak_bytes=int(peak), final_bytes=int(events[-1][2] - baseline))


def _worker(rank: int, probes: list[MemoryProbe], port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    world_size = probes[0].world_size
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = []
        for probe in probes:
            # Objects of the previous probe must be gone before this one's profile
            # starts, or their late release would lower the totals it sees.
            gc.collect()
            results.append(asdict(_run_steps(probe, rank)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def measure_peak_memory(probes: Sequence[MemoryProbe]) -> list[list[MeasuredPeak]]:
    """Run each probe's training steps on ``probe.world_size`` CPU processes and return,
    per probe, each rank's measured peak (see the module docstring for how).

    Probes with the same world size share one set of processes, which saves the
    seconds each process spends importing torch.
    """
    results: dict[int, list[MeasuredPeak]] = {}
    by_size: dict[int, list[int]] = {}
    for index, probe in enumerate(probes):
        by_size.setdefault(probe.world_size, []).append(index)
    for world_size, indices in by_size.items():
        group = [probes[i] for i in indices]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_worker, args=(group, _free_port(), out_dir), nprocs=world_size, join=True)
            per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
        for position, index in enumerate(indices):
            results[index] = [MeasuredPeak(**per_rank[r][position]) for r in range(world_size)]
    return [results[i] for i in range(len(probes))]
