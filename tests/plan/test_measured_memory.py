"""The memory estimate against the measured peak of real CPU training steps.

How memory is measured (``meshyard.plan.measure``): each rank runs two training steps
(forward, fp32 cross-entropy, backward, AdamW step, zero_grad) of a GPT built and
parallelised by meshyard's own code, on gloo CPU processes with one thread each,
under ``torch.profiler`` with ``profile_memory=True``. The peak is the highest running
total of live bytes that c10's CPU allocator reports, minus its total before the
model was built; the largest rank's peak is compared. The estimate is
``estimate_memory`` for the same layout in fp32 with the CPU's single-tensor AdamW.
"""

from __future__ import annotations

import pytest

from meshyard.plan.measure import MemoryProbe, measure_peak_memory
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import describe_gpt

TOLERANCE = 0.15
PROBES = [
    MemoryProbe("gpt-tiny", "none", world_size=1, micro_batch=8),
    MemoryProbe("gpt-small", "none", world_size=1, micro_batch=4),
    MemoryProbe("gpt-small", "ddp", world_size=2, micro_batch=4),
    MemoryProbe("gpt-small", "fsdp", world_size=2, micro_batch=4),
    MemoryProbe("gpt-small", "tp", world_size=2, micro_batch=4),
]


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    results = measure_peak_memory(PROBES)
    return {probe.label(): max(rank.peak_bytes for rank in ranks) for probe, ranks in zip(PROBES, results)}


@pytest.mark.parametrize("probe", PROBES, ids=MemoryProbe.label)
def test_estimate_within_15_percent_of_measured_peak(probe, measured):
    estimate = estimate_memory(describe_gpt(probe.shape()), probe.layout(), foreach=False)
    actual = measured[probe.label()]
    assert abs(estimate.peak_bytes - actual) <= TOLERANCE * actual, (
        f"{probe.label()}: estimated {estimate.peak_bytes / 1e6:.2f} MB, measured {actual / 1e6:.2f} MB")
