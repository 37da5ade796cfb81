"""What a parallel layout implies, decided once.

A layout is the configured parallelism (``ParallelConfig``) on concrete degrees
(``ParallelDims``). Many parts of a run depend on what it implies: whether 'ddp' is
carried out by FSDP2 replication, whether the loss is computed on vocabulary-sharded
logits, who casts parameters to the compute dtype, whether gradients are sharded,
whether the optimizer state is partitioned by ZeRO-1, whether the model is built on
the meta device, which step runner drives it. ``Layout`` answers each of these in one
property; parallelization, the trainer builder, the checkpointer, validation and the
memory probe ask it instead of re-deriving the answer from the strategy string.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshyard.config.sections import ParallelConfig
from meshyard.runtime.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    """A ``ParallelConfig`` on resolved degrees, and everything that follows from it."""

    cfg: ParallelConfig
    dims: ParallelDims

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> "Layout":
        """Degrees left at 0 in ``cfg`` filled from the strategy and the world size
        (``ParallelDims.resolve``; raises ``ParallelDimsError`` when they do not fit)."""
        dims = ParallelDims.resolve(cfg.strategy, world_size, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.pp, cfg.cp,
                                    cfg.ep)
        return cls(cfg, dims)

    # --- how data parallelism is carried out -------------------------------------------------
    @property
    def replicates_with_fsdp(self) -> bool:
        """Whether ``strategy = 'ddp'`` is carried out by FSDP2 on (dp_replicate, dp_shard =
        1): parameters replicated and gradients all-reduced, as DDP would, for models DDP
        cannot wrap. Pipeline stages: DDP's reducer does not follow a schedule's
        interleaved micro-batch backwards. Tensor-parallel models: DDP takes no DTensor
        parameters, and torch's DDP + TP path (``device_mesh=``) swaps them for plain
        attributes after the first forward, leaving no parameters to clip, optimize or
        checkpoint. Under context parallelism the cp ranks are replicas too (gradients
        reduced over dp_replicate x cp): a tensor-parallel model is then replicated by
        FSDP2 even with dp_replicate = 1."""
        dims = self.dims
        return self.cfg.strategy == "ddp" and (dims.pp > 1 or (dims.tp > 1 and dims.dp_replicate * dims.cp > 1))

    @property
    def shards_nothing(self) -> bool:
        """Whether ``strategy = 'fsdp'`` on a single rank (no offload) has nothing to shard:
        it then runs as 'none', without DTensor parameters, whose per-tensor dispatch makes
        every optimizer step slower for no memory saved. Checkpoints still move to and from
        sharded layouts (DCP reshards plain tensors too)."""
        return self.cfg.strategy == "fsdp" and self.dims.world_size == 1 and not self.cfg.cpu_offload

    @property
    def data_parallel(self) -> str:
        """The wrapper data parallelism uses: 'fsdp' (FSDP2, sharding or replicating),
        'ddp' (DistributedDataParallel, also under ZeRO-1; over dp_replicate x cp) or 'none' (one
        data-parallel rank, no context-parallel ranks to reduce gradients over, and no FSDP)."""
        if (self.cfg.strategy == "fsdp" and not self.shards_nothing) or self.replicates_with_fsdp:
            return "fsdp"
        if self.cfg.strategy in ("ddp", "zero1") and self.dims.dp_replicate * self.dims.cp > 1:
            return "ddp"
        return "none"

    @property
    def effective_cfg(self) -> ParallelConfig:
        """``cfg`` as carried out: 'ddp' by FSDP2 replication becomes 'fsdp' with
        parameters kept unsharded (one shard per replica: nothing to free after forward);
        'fsdp' on one rank becomes 'none' (``shards_nothing``)."""
        if self.shards_nothing:
            return dataclasses.replace(self.cfg, strategy="none")
        if not self.replicates_with_fsdp:
            return self.cfg
        return dataclasses.replace(self.cfg, strategy="fsdp", reshard_after_forward=False)

    @property
    def zero1(self) -> bool:
        """Whether the optimizer state is partitioned over the replicas (ZeRO-1)."""
        return self.cfg.strategy == "zero1" and self.dims.dp > 1

    # --- numerics --------------------------------------------------------------------------------
    @property
    def model_casts(self) -> bool:
        """FSDP casts parameters to the compute dtype itself (its mixed-precision policy),
        so autocast is not needed around the forward."""
        return self.data_parallel == "fsdp"

    @property
    def sharded_grads(self) -> bool:
        """Gradients are spread over ranks (DTensor shards or pipeline stages): the fp16
        scaler must agree on inf/NaN across ranks."""
        return self.model_casts or self.dims.tp > 1 or self.dims.pp > 1

    @property
    def loss_parallel(self) -> bool:
        """Loss parallel needs the loss computed by the step runner on the head's output,
        which a pipeline schedule does inside its last stage instead."""
        return self.cfg.loss_parallel and self.dims.tp > 1 and self.dims.pp == 1

    # --- model construction and execution --------------------------------------------------------
    @property
    def meta_init(self) -> bool:
        """Layouts in which no rank keeps the whole model, so it is built on the meta
        device: FSDP, or a pipeline (whose stages are replicated with FSDP when data
        parallel)."""
        return (self.cfg.strategy == "fsdp" and not self.shards_nothing) or self.dims.pp > 1

    @property
    def compiles_whole(self) -> bool:
        """Whether ``train.compile`` takes the model and its loss as one region: a whole
        model on this rank with nothing around it (no DDP or FSDP wrapper, no tensor or
        pipeline split). Otherwise each block compiles (``parallel.compile``)."""
        return self.data_parallel == "none" and self.dims.tp == 1 and not self.pipelined

    @property
    def context_parallel(self) -> bool:
        """Each sequence is split over the ``cp`` ranks, whose attention runs as a ring."""
        return self.dims.cp > 1

    @property
    def pipelined(self) -> bool:
        """A pipeline schedule drives the step (``train.pipeline_step.PipelineStep``)."""
        return self.dims.pp > 1

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per train micro-batch."""
        return self.cfg.microbatches or self.dims.pp

    def times_fsdp_waits(self, device_type: str) -> bool:
        """Whether FSDP's forward all-gather waits can be timed as communication: on CPU,
        where they block the calling thread, and without a pipeline schedule, whose
        stages run their forwards interleaved with other work."""
        return device_type != "cuda" and self.dims.pp == 1

    def stage_layout(self) -> "Layout":
        """The layout each pipeline stage is parallelized with, as a model of its own on
        the rest of the mesh: no pipeline, 'ddp' carried out as FSDP replication, and the
        loss computed inside the last stage by the schedule (no loss parallel)."""
        cfg = dataclasses.replace(self.effective_cfg, loss_parallel=False, pp=1)
        dims = dataclasses.replace(self.dims, pp=1, world_size=self.dims.world_size // self.dims.pp)
        return Layout(cfg, dims)

    def facts(self) -> dict[str, object]:
        """The layout as recorded in run.json (manifests keep the data-parallel part)."""
        dims = self.dims
        return {"strategy": self.cfg.strategy, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep, "activation_checkpointing": self.cfg.ac,
                "cpu_offload": self.effective_cfg.cpu_offload}
