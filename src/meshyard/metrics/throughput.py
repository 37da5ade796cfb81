"""Model FLOPs per token, the device's peak FLOP/s, and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs counted by the PaLM
convention (training = 3 x forward, recomputation not counted) so figures compare across
activation-checkpointing settings (``meshyard.models.flops``, the planner's formulas too).
GPUs are looked up in the hardware catalog (``meshyard.hardware``) by name;
on a CPU the peak is measured: the fastest fp32 matmuls of this rank's threads.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import nn

from meshyard.hardware import gpu_for_device_name
from meshyard.models.flops import gpt_training_flops_per_token
from meshyard.models.gpt import GPT

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Closed form for meshyard's GPT; 6 x parameters (Kaplan et al.) for other models."""
    if isinstance(model, GPT):
        return gpt_training_flops_per_token(model.shape, seq_len)
    return 6.0 * sum(p.numel() for p in model.parameters())


# Shapes of the CPU peak measurement (rows x inner x columns): squares that stay in
# cache (often the fastest), and the (tokens x width) x (width x 4 width) product of a
# transformer MLP.
PEAK_SHAPES = ((256, 256, 256), (512, 512, 512), (2048, 512, 2048))


def measured_cpu_peak(shapes: tuple[tuple[int, int, int], ...] = PEAK_SHAPES,
                      seconds_per_shape: float = 0.15) -> float:
    """Best fp32 matmul FLOP/s of this rank's threads (``torch.get_num_threads()``, the
    count training runs with): the fastest single call of each shape, at the best shape,
    timed in core seconds (``core_seconds``).

    Why not the mean wall-clock rate of one shape: ranks (and anything else on the
    machine) share the cores, and wall-clock time counts the moments a core was taken
    away, so a contended start-up measured a "peak" that training later beat (MFU read
    109-126 % for gpt-small on 2 ranks). CPU time counts only the moments the cores
    computed, so the fastest call measures what the cores deliver when they run: a rate
    a training step cannot exceed on the same threads, like a datasheet peak on a GPU.
    """
    rates = []
    for rows, inner, columns in shapes:
        a, b = torch.randn(rows, inner), torch.randn(inner, columns)
        out = torch.empty(rows, columns)
        seconds = fastest_call(lambda: torch.mm(a, b, out=out), seconds_per_shape)
        rates.append(2.0 * rows * inner * columns / seconds)
    return max(rates)


def core_seconds() -> float:
    """CPU time of this process per intra-op thread: how long a call kept its threads
    busy, leaving out the time it waited for a core. With one thread (the default per
    rank) that is the call's compute time; with several, rates derived from it are
    threads x the per-thread rate, an upper bound of what the threads do together."""
    return time.process_time() / torch.get_num_threads()


def fastest_call(call: Callable[[], object], seconds: float, least_calls: int = 3,
                 clock: Callable[[], float] = core_seconds,
                 wall_clock: Callable[[], float] = time.perf_counter) -> float:
    """Shortest duration of ``call()`` by ``clock`` over repeated calls during about
    ``seconds`` of ``wall_clock`` (at least ``least_calls`` timed calls, after one untimed
    call that warms kernel choice and caches)."""
    call()
    fastest, calls = math.inf, 0
    deadline = wall_clock() + seconds
    while calls < least_calls or wall_clock() < deadline:
        start = clock()
        call()
        fastest = min(fastest, clock() - start)
        calls += 1
    return fastest


def gpu_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """Datasheet peak of this GPU model for ``dtype``, or None when it is not in the catalog."""
    return catalog_peak(torch.cuda.get_device_name(device), dtype)


def catalog_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak for a device name such as 'NVIDIA H100 PCIe': the most specific catalog entry
    all of whose name parts appear in it (h100-pcie before h100)."""
    spec = gpu_for_device_name(device_name)
    return spec.peak_flops.get(_DTYPE_KEYS.get(dtype, "fp32")) if spec else None


def device_model(device: torch.device) -> str | None:
    """The catalog name of this GPU's model ('h100'), or None (a CPU, a GPU not in the catalog)."""
    if device.type != "cuda":
        return None
    spec = gpu_for_device_name(torch.cuda.get_device_name(device))
    return spec.name if spec else None


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s per rank, where the figure comes from)."""
    if device.type == "cuda":
        peak = gpu_peak(device, dtype)
        return peak, "datasheet" if peak else "unknown GPU"
    return measured_cpu_peak(), "measured fp32 matmul (fastest call, CPU time)"
