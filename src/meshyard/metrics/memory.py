"""Memory and device health figures of this rank: GPU allocator peaks, CPU RSS, NVML."""

from __future__ import annotations

import os
import resource
from typing import Any, Callable

import torch


class _ResidentSetReader:
    """Current resident set size, read every step from a /proc file kept open.

    Opening /proc/self/statm each step costs more than the read itself; ``pread`` on one
    descriptor rereads it at offset 0. Elsewhere than Linux it falls back to the peak.
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> int:
        if self._fd is not None:
            try:
                return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
            except (OSError, ValueError, IndexError):
                pass
        return _peak_rss_bytes()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def total_host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def nvml_handle(nvml: Any, cuda_uuid: str) -> Any:
    """NVML's handle of the GPU that CUDA reports as ``cuda_uuid``.

    CUDA indices are not NVML indices: CUDA_VISIBLE_DEVICES and Slurm's GPU binding
    renumber the devices a process sees, while NVML counts every GPU of the host, so
    NVML index ``i`` can be another job's GPU. The UUID names the same device in both.
    Torch prints it bare; NVML wants it prefixed ("GPU-", or "MIG-" for a MIG slice).
    Older pynvml releases accept only bytes.
    """
    bare = cuda_uuid.removeprefix("GPU-").removeprefix("MIG-")
    failure: Exception | None = None
    for name in (f"GPU-{bare}", f"MIG-{bare}"):
        for form in (name, name.encode()):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(form)
            except Exception as exc:  # NVMLError (not found) or TypeError (str refused)
                failure = exc
    raise LookupError(f"NVML knows no GPU with UUID {bare}: {failure}")


# What NVML adds to each step's record; a figure the device does not support (MIG
# slices have no utilisation or power of their own) is dropped after its first failure.
NVML_FIGURES: dict[str, Callable[[Any, Any], float]] = {
    "gpu_utilization_pct": lambda nvml, handle: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
    "gpu_power_w": lambda nvml, handle: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
    "gpu_temperature_c": lambda nvml, handle: nvml.nvmlDeviceGetTemperature(handle, 0),
}


class MemoryProbe:
    """Reads this rank's memory once per step; NVML (nvidia-ml-py) when it is installed, on
    every ``nvml_every``-th read only (the steps that log): each NVML query costs the host
    time a GPU step should not wait for, while the allocator's figures are free.

    ``nvml`` replaces the ``pynvml`` module (tests pass a fake).
    """

    def __init__(self, device: torch.device, nvml: Any = None, nvml_every: int = 1) -> None:
        self.device = device
        self.nvml_every = max(1, nvml_every)
        self._reads = 0
        self._nvml = nvml
        self._nvml_handle = None
        self._nvml_figures = dict(NVML_FIGURES)
        self._rss = _ResidentSetReader()
        if device.type == "cuda":
            try:
                if self._nvml is None:
                    import pynvml

                    self._nvml = pynvml
                self._nvml.nvmlInit()
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                self._nvml_handle = nvml_handle(self._nvml, uuid)
            except Exception:  # no NVML library, no permission, or GPU unknown: the allocator figures remain
                self._nvml_handle = None

    @property
    def capacity(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return total_host_memory()

    def read(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {"rss_bytes": self._rss(), "peak_rss_bytes": _peak_rss_bytes()}
        figures: dict[str, Any] = {
            "gpu_allocated_bytes": torch.cuda.memory_allocated(self.device),
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
        }
        self._reads += 1
        if self._reads % self.nvml_every == 0:
            figures.update(self.nvml_figures())
        return figures

    def nvml_figures(self) -> dict[str, float]:
        """Utilisation, power and temperature of this rank's GPU (empty without NVML)."""
        figures: dict[str, float] = {}
        if self._nvml_handle is None:
            return figures
        for name, read in list(self._nvml_figures.items()):
            try:
                figures[name] = read(self._nvml, self._nvml_handle)
            except Exception:  # not supported on this device: stop asking every step
                del self._nvml_figures[name]
        return figures
