"""Where a served model runs and in what precision: ``serve.device`` and ``serve.dtype``
resolved against this machine, in one place.

``auto`` devices take the first CUDA device torch sees, else the CPU; ``auto`` precision is
bf16 on a CUDA device that supports it (half the memory and bandwidth of fp32, the range of
fp32), else fp32: on CPUs bf16 matmuls are many times slower than fp32. The weights, the KV
cache and sampling all follow the resolved device. Files written by ``meshyard export`` (TorchScript,
ONNX, safetensors, INT8 among them) run on the CPU in their own precision, whatever 'auto'
would pick; asking for another device or dtype for one is refused (``resolve_for_export``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshyard.inference.source import ModelSourceError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype for served weights and KV caches."""

    device: torch.device
    dtype: torch.dtype

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


CPU = Placement(torch.device("cpu"), torch.float32)
"""Where serving ran before it had settings: the CPU in fp32."""


def resolve_device(requested: str, cuda_count: int | None = None) -> torch.device:
    """``serve.device`` on a machine with ``cuda_count`` visible CUDA devices (default: as torch
    sees them). Raises ModelSourceError for a CUDA device that is not there."""
    count = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_count is None else cuda_count
    if requested == "auto":
        return torch.device("cuda", 0) if count > 0 else torch.device("cpu")
    if requested == "cpu":
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        raise ModelSourceError(f"serve.device = '{requested}' is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
    index = 0 if device.index is None else device.index
    if index >= count:
        seen = f"{count} CUDA device(s) are visible" if count else "no CUDA device is visible"
        raise ModelSourceError(f"serve.device = '{requested}' but {seen}; use serve.device = 'auto' or 'cpu', "
                               "or a visible device (check CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", index)


def resolve_dtype(requested: str, device: torch.device, bf16_supported: bool | None = None) -> torch.dtype:
    """``serve.dtype`` for weights on ``device``; ``bf16_supported`` defaults to what torch says
    of that CUDA device."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ModelSourceError(f"serve.dtype = '{requested}' is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[requested]
    if device.type != "cuda":
        return torch.float32
    if bf16_supported is None:
        with torch.cuda.device(device):
            bf16_supported = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_supported else torch.float32


def resolve(device: str, dtype: str) -> Placement:
    """``serve.device`` and ``serve.dtype`` as this machine resolves them."""
    resolved = resolve_device(device)
    return Placement(resolved, resolve_dtype(dtype, resolved))


def resolve_for_export(device: str, dtype: str, what: str) -> Placement:
    """An export (``what``) runs on the CPU in the precision it was exported in: 'auto'
    settings mean that; any other device or dtype is refused with what to set instead."""
    if device not in ("auto", "cpu") or dtype not in ("auto", "fp32"):
        raise ModelSourceError(f"{what} runs on the CPU in the precision it was exported in, but serve.device = "
                               f"'{device}' and serve.dtype = '{dtype}'; set both to 'auto' (or 'cpu' and "
                               "'fp32') for it, or serve the run's checkpoint (or its Hugging Face folder) on the "
                               "GPU")
    return CPU
