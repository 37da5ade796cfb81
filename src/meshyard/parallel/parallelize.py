"""``parallelize``: the one place where parallelisms are composed, in a fixed order."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshyard.comm.hooks import GradientCompression
from meshyard.comm.registry import attach_compression
from meshyard.config.sections import CommConfig, ParallelConfig
from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp
from meshyard.runtime.parallel_dims import ParallelDims


class Parallelized(NamedTuple):
    """The module to train and the state of its gradient communication.

    ``compression`` always exists (a null object where nothing is compressed): the
    trainer adds ``compression.take_step_stats()`` to each step's record, and the
    checkpoint saves ``compression.state_dict()`` per rank.
    """

    model: nn.Module
    compression: GradientCompression


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

    Order: (tensor parallel, activation checkpointing, compile: later) then data
    parallelism, outermost, because DDP and FSDP must see the final module structure;
    the gradient-compression hook goes on the DDP module last. Returns the module to
    train (``unwrap`` recovers the plain module from it) and the compression state.
    """
    comm = comm or CommConfig()
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
