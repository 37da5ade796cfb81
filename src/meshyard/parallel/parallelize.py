"""``parallelize``: the one place where parallelisms are composed, in a fixed order."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshyard.config.sections import ParallelConfig
from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp
from meshyard.runtime.parallel_dims import ParallelDims


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    compute_dtype: torch.dtype = torch.float32,
    reduce_fp32: bool = True,
) -> nn.Module:
    """Apply the configured parallelism to ``model`` (already on its device).

    Order: (tensor parallel, activation checkpointing, compile: later) then data
    parallelism, outermost, because DDP and FSDP must see the final module structure.
    Returns the module to train; ``unwrap`` recovers the plain module from it.
    """
    if cfg.strategy == "fsdp":
        # HSDP: replicate over dp_replicate and shard over dp_shard in one 2-D mesh.
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        low_precision = compute_dtype if compute_dtype != torch.float32 else None
        reduce_dtype = torch.float32 if (low_precision and reduce_fp32) else None
        return apply_fsdp(model, dp_mesh, cfg.reshard_after_forward, low_precision, reduce_dtype)
    if cfg.strategy in ("ddp", "zero1") and dims.dp_replicate > 1:
        return apply_ddp(model, mesh["dp_replicate"], cfg.bucket_mb)
    return model
