"""A candidate layout: how a job is spread over devices, and the bytes of each number.

A ``PlannedLayout`` is what the planner varies: data-parallel degrees (replicated and
sharded), the ZeRO stage, tensor, pipeline, context- and expert-parallel degrees, micro-batch and
accumulation, activation checkpointing, CPU offload and the fused loss. ``PlanPrecision`` names
the bytes per parameter of each model state, from which the ZeRO arithmetic follows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from meshyard.config.sections import ParallelConfig

AcMode = Literal["none", "selective", "full"]
AC_MODES = ("none", "selective", "full")
"""Activation checkpointing: none, every other block recomputed (torchtitan's selective
per-layer option with frequency 2), or every block recomputed."""
PipelineSchedule = Literal["1f1b", "gpipe", "interleaved"]
STRATEGIES = ("none", "ddp", "zero1", "fsdp2", "fsdp3", "hsdp")
"""Data-parallel strategies: DDP (ZeRO-0), DDP with a sharded optimizer (ZeRO-1),
FSDP2 keeping gathered parameters until backward (ZeRO-2) or resharding after forward
(ZeRO-3), and HSDP (ZeRO-3 inside dp_shard, replicated across dp_replicate)."""
CONFIG_STRATEGIES = ("none", "ddp", "zero1", "fsdp")
"""The config's names (``parallel.strategy``), which ``meshyard plan --strategy`` also takes:
its 'fsdp' is fsdp3, or fsdp2 with ``reshard_after_forward`` false, or hsdp with
``dp_replicate`` > 1 (``planner_strategy``)."""


CONFIG_LABELS = {"none": "none", "ddp": "ddp", "zero1": "zero1", "fsdp3": "fsdp", "fsdp2": "fsdp (no reshard)",
                 "hsdp": "fsdp"}
"""How each planner strategy reads in the config's terms (``PlannedLayout.describe``)."""
CONFIG_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved1f1b"}
"""The planner's pipeline schedules as ``parallel.pp_schedule`` names them."""


def planner_strategy(parallel: ParallelConfig, dp_replicate: int = 0) -> str:
    """The planner's strategy for a config's ``[parallel]`` section: the one translation
    from the config's terms to the planner's.

    ``dp_replicate`` is the resolved replicated degree (``ParallelDims.dp_replicate``);
    0 takes the section's own (where 0, derived, means no replication for 'fsdp').
    Tensor and pipeline parallelism are degrees, not strategies: 'none' stays 'none'.
    """
    replicas = dp_replicate or parallel.dp_replicate or 1
    if parallel.strategy != "fsdp":
        return parallel.strategy
    if replicas > 1:
        return "hsdp"
    return "fsdp3" if parallel.reshard_after_forward else "fsdp2"


@dataclass(frozen=True)
class PlanPrecision:
    """Bytes per parameter of each model state, and of activations.

    ``param`` is the stored parameter the optimizer updates in place, unless ``master``
    is non-zero: then an fp32 master copy lives in the optimizer (Megatron/DeepSpeed
    style) and ``param`` is the low-precision working copy.
    """

    name: str
    param: int
    grad: int
    master: int
    state: int
    """Optimizer state bytes per parameter per state tensor (fp32 Adam moments: 4)."""
    compute: int
    """Bytes of a parameter as used in matmuls (gathered/cast copies, communication)."""
    activation: int
    """Bytes of one saved activation element."""
    peak_dtype: str
    """Which peak FLOP rate of the device applies: 'fp32', 'bf16' or 'fp16'."""

    def optimizer_bytes(self, n_states: int) -> int:
        """Master copy plus ``n_states`` moment tensors per parameter (the ZeRO paper's K)."""
        return self.master + n_states * self.state


PRECISIONS: dict[str, PlanPrecision] = {
    # Everything in fp32: 4 + 4 + 8 = 16 bytes/param with Adam. meshyard's CPU default.
    "fp32": PlanPrecision("fp32", param=4, grad=4, master=0, state=4, compute=4, activation=4, peak_dtype="fp32"),
    # meshyard on GPUs: fp32 parameters cast to bf16 for compute (FSDP2
    # MixedPrecisionPolicy or autocast), gradients reduced in fp32: 16 bytes/param.
    "bf16": PlanPrecision("bf16", param=4, grad=4, master=0, state=4, compute=2, activation=2, peak_dtype="bf16"),
    "fp16": PlanPrecision("fp16", param=4, grad=4, master=0, state=4, compute=2, activation=2, peak_dtype="fp16"),
    # Megatron/DeepSpeed mixed precision: bf16 params and grads, fp32 master + moments in
    # the optimizer: 2 + 2 + 12 = 16 bytes/param, the ZeRO paper's accounting (K = 12).
    "bf16-master": PlanPrecision(
        "bf16-master", param=2, grad=2, master=4, state=4, compute=2, activation=2, peak_dtype="bf16"
    ),
}

TRAINABLE_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""What ``meshyard plan`` offers: the precisions the trainer runs. ``bf16-master`` stays in
the table above for comparisons with the ZeRO paper and peers' accounting only; meshyard's
bf16 keeps fp32 parameters (the master) and computes in bf16, the same 16 bytes a parameter."""

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}
"""Moment tensors per parameter: Adam keeps two (m, v), SGD with momentum one."""


@dataclass(frozen=True)
class PlannedLayout:
    """One way to run a job: degrees, batch shape, numerics and memory savers."""

    strategy: str = "ddp"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 1024
    precision: PlanPrecision = PRECISIONS["bf16"]
    optimizer: str = "adamw"
    ac: AcMode = "none"
    offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer live on the host."""
    fused_loss: bool = False
    """``train.fused_linear_loss``: the output head and the cross-entropy computed together a
    block of tokens at a time, so the (tokens x vocabulary) logits never exist whole
    (meshyard's GPT, with tp = pp = 1)."""
    sequence_parallel: bool = True
    """With tp > 1, split norms and residuals along the sequence (Megatron SP)."""
    vocab_parallel: bool = True
    """With tp > 1, shard the embedding and output head over the vocabulary."""
    pp_schedule: PipelineSchedule = "1f1b"
    pp_virtual: int = 1
    """Model chunks per pipeline rank for the interleaved schedule."""
    bucket_mb: float = 25.0
    """DDP bucket size: the last bucket's all-reduce cannot overlap with backward."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (ring attention);
    they read the same samples, so they are not data-parallel, but they reduce gradients
    together (FSDP shards over dp_shard x cp)."""
    ep: int = 1
    """Expert-parallel degree (``parallel.ep``): each MoE layer's routed experts split over
    this many of the ``dp_shard`` ranks, which exchange tokens all-to-all; FSDP shards the
    experts over the other dp_shard / ep ranks, and everything else over all of dp_shard."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches run at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def zero_stage(self) -> int:
        """0 for DDP/none, 1 for a sharded optimizer, 2 or 3 for FSDP2 parameter sharding."""
        return {"none": 0, "ddp": 0, "zero1": 1, "fsdp2": 2, "fsdp3": 3, "hsdp": 3}[self.strategy]

    @property
    def shard_degree(self) -> int:
        """Ranks over which model states are sharded (the ZeRO paper's N_d)."""
        if self.strategy == "zero1":
            return self.dp
        if self.strategy in ("fsdp2", "fsdp3", "hsdp"):
            return self.dp_shard * self.cp
        return 1

    @property
    def expert_shard_degree(self) -> int:
        """Ranks over which the states of the experts a rank holds are sharded: the
        ``shard_degree`` ranks less the ``ep`` ones that hold other experts."""
        return max(1, self.shard_degree // self.ep)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across the job."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank runs per micro-batch: its share of each sequence under cp."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def n_optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    def describe(self) -> str:
        """Short label in the config's terms, such as ``fsdp dp=8 tp=2 pp=1``: ZeRO-2 reads
        ``fsdp (no reshard)`` (``parallel.reshard_after_forward = false``), HSDP
        ``fsdp dp=2x4`` (``parallel.dp_replicate = 2`` replicas of 4 shards)."""
        if self.strategy == "hsdp":
            dp = f"dp={self.dp_replicate}x{self.dp_shard}"
        else:
            dp = f"dp={self.dp}"
        context = f" cp={self.cp}" if self.cp > 1 else ""
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        return f"{CONFIG_LABELS[self.strategy]} {dp} tp={self.tp} pp={self.pp}{context}{experts}"

    def config_overrides(self) -> list[str]:
        """The settings that run this layout, as ``meshyard run`` takes them: the inverse of
        ``planner_strategy`` plus degrees, batch shape and memory savers (the fused loss on
        or off)."""
        fsdp = self.strategy in ("fsdp2", "fsdp3", "hsdp")
        overrides = [f"--parallel.strategy={'fsdp' if fsdp else self.strategy}"]
        if self.strategy == "fsdp2":
            overrides.append("--parallel.reshard_after_forward=false")
        if self.strategy == "hsdp":
            overrides.append(f"--parallel.dp_replicate={self.dp_replicate}")
        if self.tp > 1:
            overrides.append(f"--parallel.tp={self.tp}")
        if self.pp > 1:
            overrides += [f"--parallel.pp={self.pp}", f"--parallel.pp_schedule={CONFIG_SCHEDULES[self.pp_schedule]}"]
        if self.cp > 1:
            overrides.append(f"--parallel.cp={self.cp}")
        if self.ep > 1:
            overrides.append(f"--parallel.ep={self.ep}")
        if self.ac != "none":
            overrides.append(f"--parallel.ac={self.ac}")
        if self.offload:
            overrides.append("--parallel.cpu_offload=true")
        # Stated either way: a config that sets it must not outvote the plan (the fused loss
        # under tp or pp would be refused).
        overrides.append(f"--train.fused_linear_loss={'true' if self.fused_loss else 'false'}")
        return [*overrides, f"--train.global_batch={self.global_batch}", f"--train.micro_batch={self.micro_batch}",
                f"--data.seq_len={self.seq_len}"]

    def with_(self, **changes: object) -> "PlannedLayout":
        """A copy with some fields changed."""
        return replace(self, **changes)


def make_layout(strategy: str, world_size: int, tp: int = 1, pp: int = 1, shard: int = 0, cp: int = 1,
                ep: int = 1, **kwargs: object) -> PlannedLayout:
    """Build a layout from a strategy and a world size, deriving the data-parallel degrees.

    ``shard`` is the dp_shard degree for ``hsdp`` (the rest is replicated); other
    strategies replicate (ddp, zero1) or shard (fsdp2, fsdp3) over all data-parallel ranks.
    ``ep`` takes its ranks from dp_shard. Raises ValueError when the degrees do not divide
    the world size, or ep the sharded degree.
    """
    layout = _data_parallel_layout(strategy, world_size, tp, pp, shard, cp, **kwargs)
    if ep < 1 or layout.dp_shard % ep:
        raise ValueError(f"ep={ep} does not divide the sharded data-parallel degree dp_shard={layout.dp_shard} "
                         f"of {CONFIG_LABELS[strategy]}")
    return layout.with_(ep=ep) if ep > 1 else layout


def _data_parallel_layout(strategy: str, world_size: int, tp: int, pp: int, shard: int, cp: int,
                          **kwargs: object) -> PlannedLayout:
    """``make_layout`` without expert parallelism."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        raise ValueError(f"tp={tp} x pp={pp} x cp={cp} does not divide {world_size} devices")
    dp = world_size // (tp * pp * cp)
    kwargs["cp"] = cp
    if strategy == "none":
        if dp != 1:
            raise ValueError(f"strategy 'none' needs tp x pp = {world_size}, not {tp * pp}")
        return PlannedLayout(strategy=strategy, tp=tp, pp=pp, **kwargs)  # type: ignore[arg-type]
    if strategy in ("ddp", "zero1"):
        return PlannedLayout(strategy=strategy, dp_replicate=dp, tp=tp, pp=pp, **kwargs)  # type: ignore[arg-type]
    if strategy == "hsdp":
        shard = shard or dp
        if dp % shard:
            raise ValueError(f"hsdp shard degree {shard} does not divide the data-parallel degree {dp}")
        return PlannedLayout(strategy=strategy, dp_replicate=dp // shard, dp_shard=shard, tp=tp, pp=pp,
                      **kwargs)  # type: ignore[arg-type]
    return PlannedLayout(strategy=strategy, dp_shard=dp, tp=tp, pp=pp, **kwargs)  # type: ignore[arg-type]
