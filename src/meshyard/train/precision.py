"""Compute precision: which dtype, the autocast context and the gradient scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPUs that support it and fp32 on CPU, where low precision is slow."""
    if requested == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPES[requested]


@dataclass
class Precision:
    """How one training step handles numerics: an autocast context and a (possibly inert) scaler."""

    dtype: torch.dtype
    device_type: str
    use_autocast: bool
    scaler: GradScaler

    @property
    def sharded_loss_scaling(self) -> bool:
        """fp16's loss scaler agreeing on inf/NaN across ranks (gradients split over them)."""
        return isinstance(self.scaler, ShardedGradScaler) and self.scaler.is_enabled()

    def autocast(self) -> ContextManager:
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def build_precision(dtype: torch.dtype, device: torch.device, sharded_grads: bool, model_casts: bool,
                    growth_interval: int = 2000) -> Precision:
    """``model_casts``: FSDP casts through its mixed-precision policy, so no autocast.
    ``sharded_grads``: gradients are split over ranks (FSDP, TP, pipeline stages), so
    the scaler must agree on inf/NaN across ranks (an all-reduce of its finding).
    ``growth_interval``: clean fp16 steps before the loss scale doubles."""
    scaler_cls = ShardedGradScaler if sharded_grads else GradScaler
    scaler = scaler_cls(device.type, growth_interval=growth_interval, enabled=dtype == torch.float16)
    use_autocast = dtype != torch.float32 and not model_casts
    return Precision(dtype=dtype, device_type=device.type, use_autocast=use_autocast, scaler=scaler)
