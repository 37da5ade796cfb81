"""Step figures on a GPU: the CUDA-event breakdown, NVML readings and MFU."""

from __future__ import annotations

import pytest
import torch

import meshyard
from meshyard.metrics.memory import nvml_handle
from meshyard.metrics.throughput import catalog_peak
from meshyard.metrics.timing import PHASES

pytestmark = pytest.mark.gpu

# The phases are CUDA-event intervals inside the host-timed step; what they leave out
# (Python between phases) is small but not zero, so the parts must add up to the step
# within 5 % (+ 2 ms), and the uncovered rest stay under a quarter of it.
SUM_TOLERANCE = 0.05


def _records(make_config, strategy: str, *overrides: str) -> list[dict]:
    cfg = make_config("--run.device=cuda", f"--parallel.strategy={strategy}", "--train.steps=8", "--metrics.mfu=true",
                      *overrides)
    return meshyard.run(cfg, nproc=1).metrics()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cuda_event_breakdown_adds_up_to_the_step(make_config, strategy):
    records = _records(make_config, strategy)
    for record in records[2:]:  # the first steps also start CUDA libraries
        step = record["step_time_s"]
        phases = {phase: record[f"{phase}_s"] for phase in PHASES}
        assert all(seconds >= 0 for seconds in phases.values()), record
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, record
        measured = sum(phases.values())
        assert measured <= step * (1 + SUM_TOLERANCE) + 0.002, record  # no phase outlasts the step
        assert measured + record["other_s"] == pytest.approx(step, rel=SUM_TOLERANCE, abs=0.002), record
        assert record["other_s"] < 0.25 * step + 0.002, record


def test_nvml_figures_are_this_ranks_gpu(make_config):
    pynvml = pytest.importorskip("pynvml")
    records = _records(make_config, "ddp", "--metrics.log_every=2")
    assert [record["step"] for record in records if "gpu_power_w" in record] == [2, 4, 6, 8]  # logging steps
    for record in records[1::2]:
        assert 0 <= record["gpu_utilization_pct"] <= 100, record
        assert record["gpu_power_w"] > 0 and 0 < record["gpu_temperature_c"] < 120, record
    # The handle the probe uses is found by UUID: NVML names the GPU CUDA computes on.
    pynvml.nvmlInit()
    cuda_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    nvml_uuid = pynvml.nvmlDeviceGetUUID(nvml_handle(pynvml, cuda_uuid))
    nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
    assert nvml_uuid.endswith(cuda_uuid)


def test_mfu_is_against_the_datasheet_peak(make_config):
    if catalog_peak(torch.cuda.get_device_name(0), torch.bfloat16) is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in the planner's GPU catalog")
    records = _records(make_config, "ddp", "--precision.dtype=bf16")
    assert all(0 < record["mfu"] < 1 and record["model_tflops"] > 0 for record in records)
