"""Measured peak memory of real training steps on CPU, to check the estimator against.

How memory is measured: each rank runs its steps under ``torch.profiler`` with
``profile_memory=True``, which reports every allocation and free made through c10's CPU
allocator on the threads it records, with its address. The peak is the most bytes live
at once among those allocated during the steps, counted by address (``_peak_live_bytes``).
Inputs, parameters, gradients, optimizer states, activations and the tensors collectives
allocate are all counted; memory that gloo or the C++ runtime allocate outside c10
(and Python objects) is not, which matches what the estimator models on a GPU, where
NCCL's buffers are also outside the caching allocator.

The steps are meshyard's: the model from ``meshyard.models.gpt``, wrapped by the
same ``meshyard.parallel.parallelize`` a run uses (TP, activation checkpointing, then
DDP with gradients as bucket views or FSDP2 per block then the root), AdamW (or
ZeRO-1's sharded AdamW) from ``meshyard.train.optim.build_optimizer``, the trainer's
fp32 next-token loss (or the model's fused one, ``train.fused_linear_loss``), and
``zero_grad(set_to_none=True)``. Ranks are
``torch.multiprocessing`` processes on gloo, one thread each.
"""

from __future__ import annotations

import gc
import json
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.plan.layout import PRECISIONS, PlannedLayout, make_layout, planner_strategy

if TYPE_CHECKING:
    from meshyard.config.sections import ParallelConfig

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
    fused_loss: bool = False
    """The model computes its loss from the hidden states (``train.fused_linear_loss``)."""

    def shape(self) -> GPTShape:
        return GPTShape(vocab_size=self.vocab_size, context_length=self.seq_len, **GPT_PRESETS[self.preset])

    def layout(self) -> PlannedLayout:
        """The layout the estimator should be given for this probe (fp32, CPU AdamW)."""
        tp = self.world_size if self.strategy == "tp" else 1
        # meshyard's TP splits embedding and head by vocabulary; the probe splits no sequence.
        return make_layout(planner_strategy(_parallel_config(self)), self.world_size, tp=tp,
                           micro_batch=self.micro_batch, seq_len=self.seq_len, precision=PRECISIONS["fp32"],
                           ac="full" if self.checkpoint else "none", sequence_parallel=False,
                           vocab_parallel=True, fused_loss=self.fused_loss)

    def label(self) -> str:
        savers = (" +ac" if self.checkpoint else "") + (" +fused" if self.fused_loss else "")
        return f"{self.preset} {self.strategy}{savers} x{self.world_size}"


@dataclass(frozen=True)
class MeasuredPeak:
    """Peak live bytes of one rank over the building of its model and its steps."""

    rank: int
    peak_bytes: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_call_peak(call: Callable[[], object]) -> int:
    """Peak bytes that c10's CPU allocator held for what ``call`` allocated, measured as
    the module docstring says (what ``call`` returns is dropped after)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
        del result
    return _peak_live_bytes(_allocator_events(prof))


def _peak_live_bytes(events: list[tuple[int, int, int]]) -> int:
    """The most bytes live at once among the allocations in ``events``, each retired by
    its free or by the next allocation at its address.

    Not the allocator's running total: a collective's buffers are often freed on threads
    the profiler does not record (gloo's), so their frees never arrive and that total
    drifts up over the steps: gpt-small under tp = 2 on CPU peaked at 123-143 MB by it,
    varying run to run and rank to rank with which thread dropped them last, against
    121.5-123 MB counted here. The address such a buffer comes back at retires it; one
    never allocated again stays counted, so the figure can only err high. Frees of what
    was allocated before (addresses never allocated here) are left out."""
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, address in events:
        if size > 0:
            total += size - live.get(address, 0)
            live[address] = size
            peak = max(peak, total)
        else:
            total -= live.pop(address, 0)
    return peak


def _allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(time, bytes allocated (negative: freed), address) of every CPU allocator event the
    profiler saw, in time order.

    Read from the profiler's event tree: the public ``events()`` folds allocations into
    the operators that made them and loses their order, which the peak needs.
    """
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        stack.extend(node.children)
    return sorted(events)


def _parallel_config(probe: MemoryProbe) -> "ParallelConfig":
    """The probe's strategy as meshyard's own parallel config (fp32, full checkpointing
    when asked). Tensor parallelism gathers the logits (no loss parallel) for the
    probe's plain loss, and splits no sequence, as the estimator is told."""
    from meshyard.config.sections import ParallelConfig

    strategy = {"fsdp-zero2": "fsdp", "tp": "none"}.get(probe.strategy, probe.strategy)
    return ParallelConfig(strategy=strategy, tp=probe.world_size if probe.strategy == "tp" else 1,
                          reshard_after_forward=probe.strategy != "fsdp-zero2", sequence_parallel=False,
                          loss_parallel=False, ac="full" if probe.checkpoint else "none")


def _parallelize(model: GPT, probe: MemoryProbe) -> tuple[torch.nn.Module, bool]:
    """Wrap ``model`` with meshyard's ``parallelize`` for the probe's layout; returns the
    module to train and whether its optimizer partitions the state (ZeRO-1)."""
    from meshyard.parallel.layout import Layout
    from meshyard.parallel.parallelize import parallelize

    layout = Layout.resolve(_parallel_config(probe), probe.world_size)
    mesh, _ = layout.dims.build_mesh("cpu")
    return parallelize(model, layout, mesh).model, layout.zero1


def _run_steps(probe: MemoryProbe, rank: int) -> MeasuredPeak:
    from meshyard.config.sections import OptimConfig
    from meshyard.parallel.data_parallel import unwrap
    from meshyard.train.optim import build_optimizer

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, probe.vocab_size, (probe.micro_batch, probe.seq_len + 1), generator=generator)
               for _ in range(probe.steps)]

    def train() -> object:
        model, zero1 = _parallelize(GPT(probe.shape()), probe)
        optimizer = build_optimizer(unwrap(model), OptimConfig(), 1e-3, shard_group=dist.group.WORLD if zero1 else None)
        for tokens in batches:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            loss = _loss(model, inputs, targets, probe.fused_loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer

    # From before the model exists to the end of its steps.
    return MeasuredPeak(rank=rank, peak_bytes=measure_call_peak(train))


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fused: bool) -> torch.Tensor:
    """The trainer's loss: fp32 cross-entropy over the flattened positions, or the model's
    own from its hidden states (``fused``), as ``Trainer`` computes them."""
    if fused:
        return model(inputs, targets=targets)
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _worker(rank: int, probes: list[MemoryProbe], port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    world_size = probes[0].world_size
    # One process too: meshyard's parallelize builds its layout on a DeviceMesh.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = []
        for probe in probes:
            # The previous probe's objects go before this one's profile starts: its steps
            # then run in the memory they would have alone.
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
