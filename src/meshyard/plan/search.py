"""The strategy planner: enumerate layouts, keep those that fit, rank them by speed.

Layouts vary the data-parallel strategy, tensor, pipeline, context- and expert-parallel
degrees, activation checkpointing, CPU offload, the fused loss and the micro-batch; the
global batch, sequence length, precision and optimizer are fixed by the user. Of each
(strategy, tp, pp, cp, ep) family only the fastest variant that fits is kept, so the
ranking shows different layouts rather than batch sizes. A family none of whose variants
fits is reported once, with its smallest-memory attempt and what fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from meshyard.plan.cost import DEFAULT_OVERLAP, StepEstimate, estimate_step
from meshyard.plan.hardware import Cluster
from meshyard.plan.layout import AC_MODES, CONFIG_LABELS, STRATEGIES, PlannedLayout, PlanPrecision, make_layout
from meshyard.plan.memory import MemoryEstimate, estimate_memory, usable_bytes
from meshyard.plan.model import ModelDescription
from meshyard.plan.units import fmt_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What the user fixed, and which choices the planner may explore."""

    global_batch: int
    seq_len: int
    precision: PlanPrecision
    optimizer: str = "adamw"
    strategies: tuple[str, ...] = STRATEGIES
    tp: tuple[int, ...] = ()
    """Tensor-parallel degrees to try; empty: powers of two up to a node."""
    pp: tuple[int, ...] = ()
    """Pipeline degrees to try; empty: powers of two up to the layer count."""
    cp: tuple[int, ...] = (1,)
    """Context-parallel degrees to try (only those asked for: they pay off for long sequences)."""
    ep: tuple[int, ...] = ()
    """Expert-parallel degrees to try; empty: 1, and for a mixture-of-experts model every
    power of two up to the GPUs that divides its experts."""
    micro_batches: tuple[int, ...] = ()
    """Micro-batch sizes to try; empty: every power of two dividing the per-rank batch."""
    ac: tuple[str, ...] = AC_MODES
    offload: tuple[bool, ...] = (False, True)
    fused_loss: tuple[bool, ...] = (False, True)
    """Plain and/or fused loss (``train.fused_linear_loss``) to try; the fused one only where it
    runs (``fused_loss_problem``)."""
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    sequence_parallel: bool = True
    headroom: float = 0.1
    """Fraction of device memory kept free (CUDA context, NCCL, fragmentation)."""
    overlap: float = DEFAULT_OVERLAP


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its memory and time estimates."""

    layout: PlannedLayout
    memory: MemoryEstimate
    step: StepEstimate


@dataclass(frozen=True)
class Rejection:
    """A family of layouts that cannot run, and why."""

    label: str
    reason: str
    needed_bytes: float = 0.0


@dataclass
class PlanResult:
    feasible: list[Candidate] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    usable_bytes: float = 0.0


def _powers_of_two(limit: int) -> list[int]:
    values, v = [], 1
    while v <= limit:
        values.append(v)
        v *= 2
    return values


def structural_problem(desc: ModelDescription, cluster: Cluster, strategy: str, tp: int, pp: int,
                       request: PlanRequest, cp: int = 1) -> str | None:
    """Why (strategy, tp, pp, cp) cannot run at all on this cluster and model, or None."""
    n = cluster.n_gpus
    if n % (tp * pp * cp):
        return f"tp x pp x cp = {tp * pp * cp} does not divide {n} GPUs"
    dp = n // (tp * pp * cp)
    if strategy == "zero1" and (tp > 1 or pp > 1):
        return "zero1 runs without tensor and pipeline parallelism in meshyard; fsdp shards alongside them"
    if tp > 1 and not desc.tp_capable:
        return "tensor parallelism needs a known block layout (GPT presets or custom GPT sizes)"
    if tp > cluster.gpus_per_node:
        return f"tp={tp} spans nodes: its per-layer all-reduces would cross the {cluster.inter.name} link"
    if tp > 1 and desc.n_head % tp:
        return f"n_head={desc.n_head} is not divisible by tp={tp}"
    if pp > desc.n_layer:
        return f"pp={pp} exceeds the {desc.n_layer} layers"
    if request.global_batch % dp:
        return f"global batch {request.global_batch} is not divisible by dp={dp}"
    if cluster.peak(request.precision.peak_dtype) <= 0:
        return f"{cluster.gpu.name} has no {request.precision.peak_dtype} support"
    return None


def redundant(strategy: str, dp: int, shard: int) -> bool:
    """Families that duplicate another: data-parallel strategies without data
    parallelism ('none' covers them), 'none' with it, HSDP within one shard group."""
    if dp == 0:
        return False
    if (strategy == "none") != (dp == 1):
        return True
    return strategy == "hsdp" and (dp <= shard or dp % shard != 0)


def _hsdp_shard(cluster: Cluster, tp: int) -> int:
    """HSDP shards inside a node and replicates across nodes."""
    return max(1, cluster.gpus_per_node // tp)


def _variants(request: PlanRequest, per_rank: int, strategy: str,
              fused: tuple[bool, ...]) -> Iterable[tuple[str, bool, bool, int]]:
    """(ac, offload, fused loss, micro-batch) of a family; ``fused``: the losses it runs."""
    micro = request.micro_batches or tuple(_powers_of_two(per_rank))
    for ac in request.ac:
        for offload in request.offload:
            if offload and strategy not in ("fsdp3", "hsdp"):
                continue
            for fused_loss in fused:
                for mb in micro:
                    if per_rank % mb == 0:
                        yield ac, offload, fused_loss, mb


def fused_loss_problem(desc: ModelDescription, tp: int, pp: int) -> str | None:
    """Why the fused loss cannot run with (tp, pp) for this model, or None (``config.checks``
    and the trainer say the same to a run)."""
    if not desc.fuses_head_loss:
        return f"the fused loss needs meshyard's GPT, whose forward computes the loss; {desc.name} returns logits"
    if tp > 1:
        return f"the fused loss does not combine with tp={tp} (the head is split over the vocabulary)"
    if pp > 1:
        return f"the fused loss does not combine with pp={pp} (the last stage computes the loss from logits)"
    return None


def _fused_options(desc: ModelDescription, request: PlanRequest, tp: int, pp: int) -> tuple[bool, ...]:
    """The losses a family tries: those asked for, less the fused one where it cannot run."""
    if fused_loss_problem(desc, tp, pp) is None:
        return request.fused_loss
    return tuple(fused for fused in request.fused_loss if not fused)


def _fused_request_problem(desc: ModelDescription, request: PlanRequest, tp: int, pp: int) -> str | None:
    """Why a family runs none of the losses asked for (the fused one alone, where it cannot run)."""
    if _fused_options(desc, request, tp, pp):
        return None
    return fused_loss_problem(desc, tp, pp)


def _saving_key(memory: MemoryEstimate, layout: PlannedLayout) -> tuple[float, int, int, bool, bool]:
    """Order of failed attempts: least memory, then the strongest savers (smallest
    micro-batch, most recomputation, offload, fused loss), so the message names what was tried."""
    return (round(memory.peak_bytes), layout.micro_batch, -AC_MODES.index(layout.ac), not layout.offload,
            not layout.fused_loss)


def _better(step: StepEstimate, memory: MemoryEstimate, layout: PlannedLayout, best: Candidate) -> bool:
    """Faster wins; within half a percent (the model's resolution) the plain loss wins over
    the fused one (a setting fewer, for memory alone), then less memory wins."""
    ours, theirs = step.tokens_per_second, best.step.tokens_per_second
    if ours > theirs * 1.005:
        return True
    if ours < theirs * 0.995:
        return False
    if layout.fused_loss != best.layout.fused_loss:
        return not layout.fused_loss
    return memory.peak_bytes < best.memory.peak_bytes


def _family_label(strategy: str, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> str:
    return (f"{CONFIG_LABELS[strategy]} dp={dp} tp={tp} pp={pp}" + (f" cp={cp}" if cp > 1 else "")
            + (f" ep={ep}" if ep > 1 else ""))



def _expert_degrees(desc: ModelDescription, cluster: Cluster, request: PlanRequest) -> tuple[int, ...]:
    """The ep degrees to try: those asked for, else 1 and (with experts) the powers of two
    up to the GPUs that divide them."""
    if request.ep:
        return request.ep
    return tuple(ep for ep in _powers_of_two(cluster.n_gpus) if ep == 1 or (desc.experts and desc.experts % ep == 0))


def plan(desc: ModelDescription, cluster: Cluster, request: PlanRequest) -> PlanResult:
    """Every layout family for ``cluster``: the best feasible variant of each, ranked
    fastest first, and the reason each infeasible family fails."""
    usable = usable_bytes(cluster.gpu.memory, request.headroom)
    result = PlanResult(usable_bytes=usable)
    tps = request.tp or tuple(_powers_of_two(2 * cluster.gpus_per_node))
    pps = request.pp or tuple(_powers_of_two(min(desc.n_layer, cluster.n_gpus)))
    families = [(strategy, tp, pp, cp, ep) for strategy in request.strategies for tp in tps for pp in pps
                for cp in request.cp for ep in _expert_degrees(desc, cluster, request)]
    for strategy, tp, pp, cp, ep in families:
        if cluster.n_gpus % (tp * pp * cp):
            continue  # not a layout of this many GPUs at all
        dp = cluster.n_gpus // (tp * pp * cp)
        # Under cp, ddp and fsdp reduce gradients over the cp ranks even with dp = 1.
        if redundant(strategy, dp, _hsdp_shard(cluster, tp * cp)) and (cp == 1 or strategy in ("none", "hsdp")):
            continue
        label = _family_label(strategy, tp, pp, dp, cp, ep)
        moe_problem = _moe_problem(desc, cluster, strategy, tp, pp, cp, ep)
        if moe_problem and ep > 1 and not request.ep:
            continue  # an ep degree nobody asked for, where it cannot run: no news
        problem = (structural_problem(desc, cluster, strategy, tp, pp, request, cp)
                   or _cp_problem(strategy, pp, cp, request.seq_len) or moe_problem
                   or _fused_request_problem(desc, request, tp, pp))
        if problem:
            result.rejected.append(Rejection(label, problem))
            continue
        _plan_family(desc, cluster, request, strategy, tp, pp, usable, result, cp, ep)
    result.feasible.sort(key=lambda c: -c.step.tokens_per_second)
    result.rejected.sort(key=lambda r: (r.needed_bytes == 0, r.needed_bytes))
    return result


def _cp_problem(strategy: str, pp: int, cp: int, seq_len: int) -> str | None:
    """What parallel.cp needs of the rest of the layout (``config.checks`` says the same)."""
    if cp == 1:
        return None
    if strategy not in ("ddp", "fsdp2", "fsdp3", "hsdp"):
        return f"cp={cp} needs gradients reduced over its ranks: ddp or fsdp, not {CONFIG_LABELS[strategy]}"
    if pp > 1:
        return f"cp={cp} does not combine with pp={pp}"
    if seq_len % (2 * cp):
        return f"seq_len {seq_len} is not divisible by 2 x cp = {2 * cp}"
    return None


def _moe_problem(desc: ModelDescription, cluster: Cluster, strategy: str, tp: int, pp: int, cp: int,
                 ep: int) -> str | None:
    """What experts and parallel.ep need of the rest of the layout (``config.checks`` and
    ``ParallelDims`` say the same to a run): a MoE model runs without pipeline and context
    parallelism; ep needs experts it divides and FSDP over a dp_shard it divides."""
    if desc.moe is not None and pp > 1:
        return f"a mixture-of-experts model does not combine with pp={pp} (its router losses stay in early stages)"
    if desc.moe is not None and cp > 1:
        return f"a mixture-of-experts model does not combine with cp={cp} (router losses on parts of sequences)"
    if ep == 1:
        return None
    if desc.moe is None:
        return f"ep={ep} splits experts, but {desc.name} has none"
    if desc.experts % ep:
        return f"the {desc.experts} experts of a block do not divide over ep={ep}"
    if strategy not in ("fsdp2", "fsdp3", "hsdp"):
        return f"ep={ep} needs fsdp (the expert weights differ between its ranks), not {CONFIG_LABELS[strategy]}"
    dp_shard = _hsdp_shard(cluster, tp * cp) if strategy == "hsdp" else cluster.n_gpus // (tp * pp * cp)
    if dp_shard % ep:
        return f"ep={ep} does not divide the sharded data-parallel degree dp_shard={dp_shard}"
    return None


def _plan_family(desc: ModelDescription, cluster: Cluster, request: PlanRequest, strategy: str, tp: int, pp: int,
                 usable: float, result: PlanResult, cp: int = 1, ep: int = 1) -> None:
    """Add the fastest variant of (strategy, tp, pp, cp, ep) that fits, or why none does."""
    dp = cluster.n_gpus // (tp * pp * cp)
    per_rank = request.global_batch // dp
    best: Candidate | None = None
    closest: tuple[MemoryEstimate, PlannedLayout] | None = None
    losses = _fused_options(desc, request, tp, pp)
    for ac, offload, fused_loss, mb in _variants(request, per_rank, strategy, losses):
        layout = make_layout(
            strategy, cluster.n_gpus, tp=tp, pp=pp, cp=cp, ep=ep, shard=max(1, _hsdp_shard(cluster, tp * cp)),
            micro_batch=mb, grad_accum=per_rank // mb, seq_len=request.seq_len, precision=request.precision,
            optimizer=request.optimizer, ac=ac, offload=offload, fused_loss=fused_loss,
            sequence_parallel=request.sequence_parallel, pp_schedule=request.pp_schedule, pp_virtual=request.pp_virtual,
        )
        memory = estimate_memory(desc, layout)
        if memory.peak_bytes > usable:
            if closest is None or _saving_key(memory, layout) < _saving_key(*closest):
                closest = (memory, layout)
            continue
        step = estimate_step(desc, layout, cluster, overlap=request.overlap)
        if best is None or _better(step, memory, layout, best):
            best = Candidate(layout, memory, step)
    label = _family_label(strategy, tp, pp, dp, cp, ep)
    if best is not None:
        result.feasible.append(best)
    elif closest is not None:
        result.rejected.append(_out_of_memory(label, *closest, usable))
    else:
        result.rejected.append(Rejection(label, "no micro-batch in the requested list divides the "
                                                f"{per_rank} samples each rank gets"))


def _out_of_memory(label: str, memory: MemoryEstimate, layout: PlannedLayout, usable: float) -> Rejection:
    """The rejection of a family, quoting its smallest attempt and what fills it."""
    top = sorted(memory.items, key=lambda i: -i.bytes)[:2]
    parts = ", ".join(f"{i.name} {fmt_bytes(i.bytes)}" for i in top)
    saver = (f"micro-batch {layout.micro_batch}, ac={layout.ac}" + (", offload" if layout.offload else "")
             + (", fused loss" if layout.fused_loss else ""))
    reason = (f"out of memory: needs {fmt_bytes(memory.peak_bytes)} > {fmt_bytes(usable)} usable even with "
              f"{saver} (largest: {parts})")
    return Rejection(label, reason, memory.peak_bytes)
