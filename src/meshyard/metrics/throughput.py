"""Model FLOPs per token, the device's peak FLOP/s, and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs counted by the PaLM
convention (training = 3 x forward, recomputation not counted) so figures compare across
activation-checkpointing settings. GPUs are looked up in the planner's catalog by name;
on a CPU the peak is measured: a square fp32 matmul timed on this rank's threads.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from meshyard.models.gpt import GPT
from meshyard.plan.hardware import GPUS
from meshyard.plan.model import describe_gpt

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Closed form for meshyard's GPT; 6 x parameters (Kaplan et al.) for other models."""
    if isinstance(model, GPT):
        return describe_gpt(model.shape).training_flops_per_token(seq_len)
    return 6.0 * sum(p.numel() for p in model.parameters())


def measured_cpu_peak(size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of repeated ``size`` x ``size`` fp32 matmuls with the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm up the kernel selection
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    return 2.0 * size**3 * count / (time.perf_counter() - start)


def gpu_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """Datasheet peak of this GPU model for ``dtype``, or None when it is not in the catalog."""
    return catalog_peak(torch.cuda.get_device_name(device), dtype)


def catalog_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak for a device name such as 'NVIDIA H100 PCIe': the most specific catalog entry
    all of whose name parts appear in it (h100-pcie before h100)."""
    name = device_name.lower()
    matches = [spec for spec in GPUS.values() if all(part in name for part in spec.name.split("-"))]
    if not matches:
        return None
    best = max(matches, key=lambda spec: len(spec.name))
    return best.peak_flops.get(_DTYPE_KEYS.get(dtype, "fp32"))


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s per rank, where the figure comes from)."""
    if device.type == "cuda":
        peak = gpu_peak(device, dtype)
        return peak, "datasheet" if peak else "unknown GPU"
    return measured_cpu_peak(), "measured fp32 matmul"
