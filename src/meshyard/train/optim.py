"""Optimizers (AdamW, SGD, ZeRO-1 sharded), learning-rate schedule and batch-size scaling."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.lr_scheduler import LambdaLR

from meshyard.config.sections import OptimConfig


def scaled_peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Peak lr after the scaling rule: linear (Goyal et al.) or sqrt (Krizhevsky; Adam-friendly)."""
    ratio = global_batch / cfg.reference_batch
    if cfg.lr_scaling == "linear":
        return cfg.lr * ratio
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Factor applied to the peak lr at optimizer step ``step`` (0-based).

    Linear warmup reaches the peak at the end of step ``warmup_steps - 1``; cosine then
    decays to ``min_lr_ratio`` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave biases and norm gains undecayed."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


FUSED_DEVICE_TYPES = frozenset({"cuda", "xpu"})
"""Devices where the optimizer step is fused (one kernel for every parameter). Elsewhere
PyTorch's default stands: on CPU a loop over the parameters, which keeps CPU runs'
numbers as they were."""


def step_implementation(parameters: list[nn.Parameter]) -> str:
    """'fused' when every parameter is a floating-point tensor (plain or DTensor: FSDP's
    shards, TP's pieces) on a device of ``FUSED_DEVICE_TYPES``; otherwise 'foreach' where
    PyTorch defaults to it (every parameter on an accelerator) and 'for-loop' on CPU."""
    on_accelerators = bool(parameters) and all(p.device.type in FUSED_DEVICE_TYPES for p in parameters)
    if on_accelerators and all(p.is_floating_point() for p in parameters):
        return "fused"
    return "foreach" if on_accelerators else "for-loop"


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, peak_lr: float, shard_group: torch.distributed.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer, fused where ``step_implementation`` says so; with
    ``shard_group`` its state is sharded over it (ZeRO-1)."""
    fused = step_implementation([p for p in model.parameters() if p.requires_grad]) == "fused"
    speed = {"fused": True} if fused else {}
    if cfg.name == "adamw":
        cls, kwargs = torch.optim.AdamW, {"betas": tuple(cfg.betas), "eps": cfg.eps, **speed}
    else:
        cls, kwargs = torch.optim.SGD, {"momentum": cfg.momentum, **speed}
    groups = parameter_groups(model, cfg.weight_decay)
    if shard_group is None:
        return cls(groups, lr=peak_lr, **kwargs)
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, process_group=shard_group,
                                   lr=peak_lr, weight_decay=cfg.weight_decay, **kwargs)
    zero.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
    return zero


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    fn = partial(lr_multiplier, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                 schedule=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio)
    return LambdaLR(optimizer, fn)
