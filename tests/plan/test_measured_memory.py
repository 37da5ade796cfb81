"""The memory estimate against the measured peak of real CPU training steps.

How memory is measured (``meshyard.plan.measure``): each rank runs two training steps
(forward, fp32 cross-entropy, backward, AdamW step, zero_grad) of a GPT built and
parallelised by meshyard's own code, on gloo CPU processes with one thread each,
under ``torch.profiler`` with ``profile_memory=True``. The peak is the highest running
total of live bytes that c10's CPU allocator reports, minus its total before the
model was built; the largest rank's peak is compared. The estimate is
``estimate_memory`` for the same layout in fp32 with the CPU's single-tensor AdamW. The
fused loss's forward is also measured alone, in blocks small enough to have several.
"""

from __future__ import annotations

import pytest
import torch

from meshyard.models.linear_cross_entropy import linear_cross_entropy
from meshyard.plan.measure import MemoryProbe, _peak_live_bytes, measure_call_peak, measure_peak_memory
from meshyard.plan.memory import estimate_memory, fused_loss_bytes
from meshyard.plan.model import describe_gpt

TOLERANCE = 0.15
PROBES = [
    MemoryProbe("gpt-tiny", "none", world_size=1, micro_batch=8),
    MemoryProbe("gpt-small", "none", world_size=1, micro_batch=4),
    MemoryProbe("gpt-small", "ddp", world_size=2, micro_batch=4),
    MemoryProbe("gpt-small", "fsdp", world_size=2, micro_batch=4),
    MemoryProbe("gpt-small", "tp", world_size=2, micro_batch=4),
    # The loss dominates: 1024 tokens x 4096 logits, one block of the fused loss.
    MemoryProbe("gpt-tiny", "none", world_size=1, micro_batch=8, vocab_size=4096, fused_loss=True),
]


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    results = measure_peak_memory(PROBES)
    return {probe.label(): max(rank.peak_bytes for rank in ranks) for probe, ranks in zip(PROBES, results)}


@pytest.mark.parametrize("probe", PROBES, ids=MemoryProbe.label)
def test_estimate_within_15_percent_of_measured_peak(probe, measured):
    estimate = estimate_memory(describe_gpt(probe.shape()), probe.layout(), on_gpu=False)
    actual = measured[probe.label()]
    assert abs(estimate.peak_bytes - actual) <= TOLERANCE * actual, (
        f"{probe.label()}: estimated {estimate.peak_bytes / 1e6:.2f} MB, measured {actual / 1e6:.2f} MB")


def test_the_peak_counts_by_address_what_the_steps_allocated():
    """A free the profiler never saw (a collective's buffer dropped on gloo's thread) is
    retired when its address is allocated again; frees of what was there before are not
    counted; the peak is the most live at once."""
    events = [(1, 100, 0xA), (2, -30, 0xF),  # 0xF was allocated before: left out
              (3, 50, 0xB),  # 150 live
              (4, 40, 0xA),  # 0xA's free was not seen: its 100 bytes retired, 90 live
              (5, -50, 0xB), (6, 70, 0xC), (7, 20, 0xD)]  # 40 + 70 + 20
    assert _peak_live_bytes(events) == 150
    assert _peak_live_bytes([*events, (8, 60, 0xE)]) == 190


@pytest.mark.parametrize("dtype, d_model, rows", [
    (torch.float32, 64, 2048),  # one block
    (torch.float32, 64, 256),  # several blocks
    (torch.float32, 512, 64),  # several blocks, large fp32 gradients
    (torch.bfloat16, 64, 256),  # under autocast: bf16 matmuls and a bf16 cast of the head
    (torch.float16, 64, 2048),
])
def test_fused_loss_bytes_match_the_measured_peak_of_the_loss(dtype, d_model, rows):
    """The fused loss's forward on CPU, measured as the probes are, against the estimate
    the planner's "loss" line is made of (blocks of ``rows`` instead of 2^25 logits)."""
    tokens, vocab = 2048, 4096
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d_model, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, d_model, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return linear_cross_entropy(hidden, weight, targets, rows_per_block=rows)

    compute = torch.finfo(dtype).bits // 8
    cast = vocab * d_model * compute if compute < 4 else 0
    estimate = fused_loss_bytes(tokens, vocab, d_model, rows) + cast
    measured = measure_call_peak(forward)
    assert abs(estimate - measured) <= 0.03 * measured, (
        f"estimated {estimate / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB")
