"""Optimizers (AdamW, SGD, ZeRO-1 sharded), learning-rate schedule and batch-size scaling."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
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


FUSED_DEVICE_TYPES = frozenset({"cuda", "xpu", "cpu"})
"""Devices with a fused optimizer step (PyTorch's fused AdamW and SGD kernels: one pass over
each parameter, in place). On CPU it is what PyTorch's default is not: its default there
is a loop over the parameters, which on a small model costs as much as a fifth of a step
(benchmarks/gpu_step.py splits the step)."""

ACCELERATOR_TYPES = frozenset({"cuda", "xpu"})
"""Devices where PyTorch's own default is the foreach step (one kernel per operation)."""


DTENSOR_FUSED_OPTIMIZERS = frozenset({"adam", "adamw"})
"""Optimizers whose fused step DTensor can run: PyTorch registers sharding strategies for
the fused Adam and AdamW kernels, not for fused SGD."""


def choose_step(device_types: set[str], dtensor_kinds: set[bool], floats: bool = True,
                sharded_loss_scaling: bool = False, optimizer: str = "adamw") -> str:
    """The optimizer step for parameters on ``device_types`` that are DTensors or not as
    ``dtensor_kinds`` says ({True}, {False} or both), all floats or not: 'fused' when they
    are floats on one device type of ``FUSED_DEVICE_TYPES``, all plain or all DTensor (FSDP's
    shards, TP's pieces; for an optimizer of ``DTENSOR_FUSED_OPTIMIZERS``); otherwise
    PyTorch's default: 'foreach' on accelerators, else 'for-loop'. The trainer's choice
    (``step_implementation``) and the planner's (``plan.memory.planned_optimizer_step``).

    A mix of plain tensors and DTensors (tensor parallelism without sequence parallelism
    leaves the norms plain) takes the loop: an operation over a list of tensors refuses the
    mix. Never fused under ``sharded_loss_scaling`` (fp16 with gradients split over ranks):
    PyTorch's ShardedGradScaler hands the step a one-element inf flag, which the fused
    step's in-place update of its scalar step counts refuses."""
    if len(dtensor_kinds) > 1:
        return "for-loop"
    fusable = (len(device_types) == 1 and device_types <= FUSED_DEVICE_TYPES and floats and not sharded_loss_scaling
               and (dtensor_kinds != {True} or optimizer in DTENSOR_FUSED_OPTIMIZERS))
    if fusable:
        return "fused"
    return "foreach" if device_types and device_types <= ACCELERATOR_TYPES else "for-loop"


def step_implementation(parameters: list[nn.Parameter], sharded_loss_scaling: bool = False,
                        optimizer: str = "adamw") -> str:
    """``choose_step`` for these parameters."""
    return choose_step({p.device.type for p in parameters}, {isinstance(p, DTensor) for p in parameters},
                       all(p.is_floating_point() for p in parameters), sharded_loss_scaling, optimizer)


STEP_OPTIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
"""The optimizer's keyword arguments for each ``step_implementation``."""


def built_step(optimizer: torch.optim.Optimizer) -> str:
    """The ``STEP_OPTIONS`` an optimizer of ``build_optimizer`` was built with (ZeRO-1's
    too: it keeps its inner optimizer's arguments as its defaults)."""
    defaults = optimizer.defaults
    return next(step for step, options in STEP_OPTIONS.items()
                if all(defaults.get(key) == value for key, value in options.items()))


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, peak_lr: float, shard_group: torch.distributed.ProcessGroup | None = None,
    sharded_loss_scaling: bool = False,
) -> torch.optim.Optimizer:
    """The configured optimizer, stepping as ``step_implementation`` says; with
    ``shard_group`` its state is sharded over it (ZeRO-1)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    speed = STEP_OPTIONS[step_implementation(trained, sharded_loss_scaling, cfg.name)]
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
