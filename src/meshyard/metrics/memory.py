"""Memory and device health figures of this rank: GPU allocator peaks, CPU RSS, NVML."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc; falls back to the peak on other systems)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def total_host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MemoryProbe:
    """Reads this rank's memory once per step; NVML (nvidia-ml-py) when it is installed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._nvml_handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            except Exception:  # no NVML library or no permission: the allocator figures remain
                self._nvml_handle = None

    @property
    def capacity(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return total_host_memory()

    def read(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {"rss_bytes": _rss_bytes(),
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        figures: dict[str, Any] = {
            "gpu_allocated_bytes": torch.cuda.memory_allocated(self.device),
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
        }
        if self._nvml_handle is not None:
            import pynvml

            figures["gpu_utilization_pct"] = pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu
            figures["gpu_power_w"] = pynvml.nvmlDeviceGetPowerUsage(self._nvml_handle) / 1000.0
            figures["gpu_temperature_c"] = pynvml.nvmlDeviceGetTemperature(self._nvml_handle, 0)
        return figures

    def peak_fraction(self) -> float:
        """Peak memory of this rank as a share of the device's (or host's) capacity."""
        figures = self.read()
        peak = figures.get("gpu_peak_reserved_bytes", figures.get("peak_rss_bytes", 0))
        return peak / self.capacity
