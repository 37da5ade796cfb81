"""Measured peak memory of real training steps on CPU, to check the estimator against.

How memory is measured: each rank runs its steps under ``torch.profiler`` with
``profile_memory=True``. Every allocation and free made through c10's CPU allocator is
reported with the allocator's running total of live bytes (``total_allocated``); the
peak is the largest total seen minus the total before the model was built. Inputs,
parameters, gradients, optimizer states, activations and the tensors collectives
allocate are all counted; memory that gloo or the C++ runtime allocate outside c10
(and Python objects) is not, which matches what the estimator models on a GPU, where
NCCL's buffers are also outside the caching allocator.

The steps are meshyard's own: the model from ``meshyard.models.gpt``, parallelised with
``meshyard.parallel.parallelize.parallelize`` (DDP with gradients as bucket views,
FSDP2 ``fully_shard`` per block then the root), AdamW from
``meshyard.train.optim.build_optimizer``, the trainer's fp32 next-token loss, and
``zero_grad(set_to_none=True)``. Ranks are ``torch.multiprocessing`` processes on gloo,
one thread each.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.plan.layout import PRECISIONS, Layout, make_layout

_STRATEGY_TO_LAYOUT = {"none": "none", "ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp3", "fsdp-zero2": "fsdp2"}


@dataclass(frozen=True)
class MemoryProbe:
    """One measured configuration: a GPT preset, a strategy and a batch shape."""

    preset: str = "gpt-tiny"
    strategy: str = "none"
    """'none', 'ddp', 'zero1', 'fsdp' (ZeRO-3) or 'fsdp-zero2' (reshard_after_forward=False)."""
    world_size: int = 1
    micro_batch: int = 8
    seq_len: int = 128
    vocab_size: int = 256
    steps: int = 3

    def shape(self) -> GPTShape:
        return GPTShape(vocab_size=self.vocab_size, context_length=self.seq_len, **GPT_PRESETS[self.preset])

    def layout(self) -> Layout:
        """The layout the estimator should be given for this probe (fp32, CPU AdamW)."""
        return make_layout(_STRATEGY_TO_LAYOUT[self.strategy], self.world_size, micro_batch=self.micro_batch,
                           seq_len=self.seq_len, precision=PRECISIONS["fp32"])


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
    event the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        stack.extend(node.children)
    return sorted(events)


def _parallelize(model: torch.nn.Module, probe: MemoryProbe) -> torch.nn.Module:
    """Wrap ``model`` the way meshyard's data-parallel strategies do, over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp

    if probe.world_size == 1:
        return model
    mesh = init_device_mesh("cpu", (probe.world_size,), mesh_dim_names=("dp",))
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


def _worker(rank: int, probe: MemoryProbe, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    if probe.world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=probe.world_size)
    try:
        result = _run_steps(probe, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(asdict(result)))


def measure_peak_memory(probe: MemoryProbe) -> list[MeasuredPeak]:
    """Run ``probe.steps`` training steps on ``probe.world_size`` CPU processes and return
    each rank's measured peak (see the module docstring for how it is measured)."""
    with tempfile.TemporaryDirectory() as out_dir:
        env_before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            mp.spawn(_worker, args=(probe, _free_port(), out_dir), nprocs=probe.world_size, join=True)
        finally:
            if env_before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_before
        return [MeasuredPeak(**json.loads(Path(out_dir, f"rank{r}.json").read_text()))
                for r in range(probe.world_size)]
