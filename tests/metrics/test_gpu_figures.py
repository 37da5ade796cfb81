"""GPU figures checked with fakes: NVML found by UUID, CUDA events read only once complete."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshyard.metrics.memory import MemoryProbe, nvml_handle
from meshyard.metrics.timing import StepTimer


class FakeNvml:
    """A host with four GPUs; NVML numbers them 0-3, whatever CUDA_VISIBLE_DEVICES says."""

    UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]

    def __init__(self, bytes_only: bool = False) -> None:
        self.bytes_only = bytes_only

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:
        if self.bytes_only and isinstance(uuid, str):
            raise TypeError("bytes or integer address expected instead of str instance")
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if uuid not in self.UUIDS:
            raise KeyError(f"NVML_ERROR_NOT_FOUND: {uuid}")
        return self.UUIDS.index(uuid)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 100_000 + handle  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 40 + handle


@pytest.mark.parametrize("bytes_only", [False, True])
def test_nvml_handle_is_found_by_uuid(bytes_only):
    nvml = FakeNvml(bytes_only)
    assert nvml_handle(nvml, "cccc") == 2  # torch prints the UUID without NVML's prefix
    assert nvml_handle(nvml, "GPU-dddd") == 3
    with pytest.raises(LookupError, match="no GPU with UUID eeee"):
        nvml_handle(nvml, "eeee")


def test_probe_reads_the_gpu_cuda_device_0_is(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=2 CUDA device 0 is NVML's GPU 2, not NVML's GPU 0."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="cccc"))
    probe = MemoryProbe(torch.device("cuda", 0), nvml=FakeNvml())
    assert probe.nvml_figures() == {"gpu_utilization_pct": 20, "gpu_power_w": 100.002, "gpu_temperature_c": 42}


def test_unsupported_nvml_figure_is_dropped(monkeypatch):
    class MigSlice(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="aaaa"))
    probe = MemoryProbe(torch.device("cuda", 0), nvml=MigSlice())
    assert set(probe.nvml_figures()) == {"gpu_utilization_pct", "gpu_temperature_c"}
    assert set(probe.nvml_figures()) == {"gpu_utilization_pct", "gpu_temperature_c"}


def test_nvml_is_asked_on_logging_steps_only(monkeypatch):
    """Each NVML query costs host time the GPU would wait for; the allocator's figures are free."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="cccc"))
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device: 1024)
    probe = MemoryProbe(torch.device("cuda", 0), nvml=FakeNvml(), nvml_every=3)
    reads = [probe.read() for _ in range(6)]
    assert ["gpu_power_w" in figures for figures in reads] == [False, False, True, False, False, True]
    assert all(figures["gpu_allocated_bytes"] == 1024 for figures in reads)


class FakeStream:
    """Events complete only when the host waits for them, as on a busy GPU."""

    def __init__(self) -> None:
        self.recorded = 0
        self.completed = 0


class FakeEvent:
    stream = FakeStream()
    clock = [0.0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.order = -1
        self.at = 0.0

    def record(self) -> None:
        FakeEvent.stream.recorded += 1
        self.order, self.at = FakeEvent.stream.recorded, FakeEvent.clock[0]
        FakeEvent.clock[0] += 0.002  # 2 ms of GPU work between consecutive events

    def synchronize(self) -> None:
        FakeEvent.stream.completed = max(FakeEvent.stream.completed, self.order)

    def elapsed_time(self, end: "FakeEvent") -> float:
        if max(self.order, end.order) > FakeEvent.stream.completed:
            raise RuntimeError("CUDA error: device not ready")
        return (end.at - self.at) * 1000.0


def test_cuda_phases_are_read_after_their_events_complete(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.stream, FakeEvent.clock = FakeStream(), [0.0]
    timer = StepTimer(torch.device("cuda", 0))
    timer.start_step()
    ddp_hook = timer.comm.wrap(lambda state, bucket: None)
    with timer.phase("forward"):
        pass
    with timer.backward():
        ddp_hook(None, None)  # the last gradient bucket is handed to the network
    with timer.phase("comm", where="sync"):
        pass  # the loss read synchronised the host before this phase's end event
    figures = timer.close_step().seconds()
    # Events 2 ms apart: backward 4 ms, of which the 4 ms from the launch to the end of
    # backward's wait are exposed communication, plus the 2 ms of the sync phase.
    assert figures["forward_s"] == pytest.approx(0.002)
    assert figures["backward_s"] == pytest.approx(0.0, abs=1e-12)
    assert figures["comm_s"] == pytest.approx(0.006)
