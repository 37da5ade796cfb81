"""``parallelize``: the one place where parallelisms are composed, in a fixed order."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshyard.comm.hooks import GradientCompression
from meshyard.comm.registry import attach_compression
from meshyard.config.sections import CommConfig, ParallelConfig
from meshyard.parallel.activation_checkpoint import apply_ac
from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp
from meshyard.parallel.pipeline import split_model
from meshyard.parallel.tensor_parallel import apply_tp
from meshyard.runtime.parallel_dims import ParallelDims


class Parallelized(NamedTuple):
    """The module to train and the state of its gradient communication.

    ``compression`` always exists (a null object where nothing is compressed): the
    trainer adds ``compression.take_step_stats()`` to each step's record, and the
    checkpoint saves ``compression.state_dict()`` per rank.
    """

    model: nn.Module
    compression: GradientCompression


def uses_loss_parallel(cfg: ParallelConfig, dims: ParallelDims) -> bool:
    """Loss parallel needs the loss computed by the step runner on the head's output,
    which a pipeline schedule does inside its last stage instead."""
    return cfg.loss_parallel and dims.tp > 1 and dims.pp == 1


def replicates_with_fsdp(cfg: ParallelConfig, dims: ParallelDims) -> bool:
    """Whether ``strategy = 'ddp'`` is carried out by FSDP2 on (dp_replicate, dp_shard =
    1): parameters replicated and gradients all-reduced, as DDP would, for models DDP
    cannot wrap. Pipeline stages: DDP's reducer does not follow a schedule's interleaved
    micro-batch backwards. Tensor-parallel models: DDP takes no DTensor parameters, and
    torch's DDP + TP path (``device_mesh=``) swaps them for plain attributes after the
    first forward, leaving no parameters to clip, optimize or checkpoint."""
    return cfg.strategy == "ddp" and (dims.pp > 1 or (dims.tp > 1 and dims.dp_replicate > 1))


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    compute_dtype: torch.dtype = torch.float32,
    reduce_fp32: bool = True,
    comm: CommConfig | None = None,
    hook_wrapper: Callable[[Callable], Callable] | None = None,
) -> Parallelized:
    """Apply the configured parallelism to ``model`` (already on its device).

    Order: pipeline split (each rank keeps its stages; every stage then goes through the
    rest as a model of its own), tensor parallel (parameters become DTensors on the
    ``tp`` mesh), activation checkpointing (wraps block forwards, so it sees the TP
    modules), (compile: later), then data parallelism, outermost, because DDP and FSDP
    must see the final module structure (FSDP over TP DTensors gives 2-D FSDP x TP); the
    gradient-compression hook goes on the DDP module last. 'ddp' over pipeline stages or
    a tensor-parallel model is FSDP2 replication (``replicates_with_fsdp``). Returns the module to train
    (``unwrap`` recovers the plain module from it; under pipelining a ``PipelinedModel``
    holding this rank's stages) and the compression state.
    """
    comm = comm or CommConfig()
    if dims.pp > 1:
        # Pipeline split first: this rank keeps only its stages, and each stage is then
        # parallelized like a whole model (TP, AC, FSDP/DDP) on the rest of the mesh.
        pipelined = split_model(model, dims.pp, mesh["pp"].get_local_rank(), cfg.pp_virtual_stages, cfg.pp_split)
        stage_dims = dataclasses.replace(dims, pp=1, world_size=dims.world_size // dims.pp)
        stage_cfg = _as_fsdp(cfg) if replicates_with_fsdp(cfg, dims) else cfg
        # The schedule computes the loss inside the last stage, on gathered logits.
        stage_cfg = dataclasses.replace(stage_cfg, loss_parallel=False)
        pipelined.wrap_stages(lambda stage: parallelize(stage, stage_dims, mesh, stage_cfg, compute_dtype,
                                                        reduce_fp32).model)
        return Parallelized(pipelined, attach_compression(pipelined, comm, hook_wrapper))
    if replicates_with_fsdp(cfg, dims):
        cfg = _as_fsdp(cfg)
    if dims.tp > 1:
        model = apply_tp(model, mesh["tp"], cfg.sequence_parallel, loss_parallel=uses_loss_parallel(cfg, dims))
    model = apply_ac(model, cfg.ac, cfg.ac_every)
    if cfg.strategy == "fsdp":
        # HSDP: replicate over dp_replicate and shard over dp_shard in one 2-D mesh.
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        low_precision = compute_dtype if compute_dtype != torch.float32 else None
        reduce_dtype = torch.float32 if (low_precision and reduce_fp32) else None
        model = apply_fsdp(model, dp_mesh, cfg.reshard_after_forward, low_precision, reduce_dtype,
                           forward_prefetch=cfg.forward_prefetch, backward_prefetch=cfg.backward_prefetch)
    elif cfg.strategy in ("ddp", "zero1") and dims.dp_replicate > 1:
        model = apply_ddp(model, mesh["dp_replicate"], cfg.bucket_mb,
                          gradient_as_bucket_view=cfg.gradient_as_bucket_view, static_graph=cfg.static_graph)
    return Parallelized(model, attach_compression(model, comm, hook_wrapper))


def _as_fsdp(cfg: ParallelConfig) -> ParallelConfig:
    """'ddp' as FSDP2 over (dp_replicate, dp_shard = 1); with one shard per replica
    there is nothing to free after forward, so parameters stay unsharded."""
    return dataclasses.replace(cfg, strategy="fsdp", reshard_after_forward=False)
