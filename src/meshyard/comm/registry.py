"""From ``comm.compression`` (a name at the config edge) to a compression object."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from meshyard.comm.hooks import CastCompression, GradientCompression, NoCompression
from meshyard.comm.powersgd import PowerSGDCompression
from meshyard.comm.topk import TopKCompression
from meshyard.config.sections import CommConfig

COMPRESSION_METHODS = ("none", "fp16", "bf16", "powersgd", "topk")


def build_compression(cfg: CommConfig, process_group: dist.ProcessGroup | None = None) -> GradientCompression:
    """The hook state for ``cfg.compression`` on ``process_group`` (not yet registered).

    'none' gives a counting plain all-reduce hook, for measurements; runs use
    ``attach_compression``, which leaves DDP's built-in all-reduce alone for 'none'.
    """
    if cfg.compression == "none":
        return GradientCompression(process_group, cfg.warmup_steps)
    if cfg.compression in ("fp16", "bf16"):
        dtype = torch.float16 if cfg.compression == "fp16" else torch.bfloat16
        return CastCompression(dtype, process_group, cfg.warmup_steps)
    if cfg.compression == "powersgd":
        return PowerSGDCompression(cfg.powersgd_rank, cfg.error_feedback, process_group, cfg.warmup_steps)
    if cfg.compression == "topk":
        return TopKCompression(cfg.topk_ratio, cfg.error_feedback, process_group, cfg.warmup_steps)
    raise ValueError(f"unknown compression '{cfg.compression}'; known: {', '.join(COMPRESSION_METHODS)}")


def attach_compression(model: nn.Module, cfg: CommConfig,
                       wrap: Callable[[Callable], Callable] | None = None) -> GradientCompression:
    """Register the configured hook on a DDP ``model`` and return its state object.

    ``wrap`` decorates the registered hook (step-time measurement uses it to see bucket
    launches); with 'none' and a ``wrap`` DDP's averaging all-reduce runs as a Python hook.

    Anything but DDP gets a ``NoCompression``: a single process reports zero bytes,
    FSDP (whose reduce-scatters a DDP hook cannot reach) reports nothing.
    """
    if not isinstance(model, DistributedDataParallel):
        return NoCompression(None if isinstance(model, FSDPModule) else 0)
    world = model.process_group.size()
    if cfg.compression == "none":
        if wrap is not None:
            model.register_comm_hook(model.process_group, wrap(allreduce_hook))
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return NoCompression(grads, world)
    compression = build_compression(cfg, model.process_group)
    compression.register(model, wrap)
    return compression
