"""Measured peak memory of CPU training steps against ``meshyard plan``'s estimate.

How memory is measured (``meshyard.plan.measure``): each rank runs two training steps
(forward, fp32 cross-entropy, backward, AdamW step, ``zero_grad(set_to_none=True)``)
of a GPT built and parallelised by meshyard's own code (DDP with gradients as bucket
views; FSDP2 ``fully_shard`` per block then the root; TP with torch's
``parallelize_module``; checkpointing with ``checkpoint_wrapper`` per block) on gloo
CPU processes, one thread each, under ``torch.profiler(profile_memory=True)``. The peak
is the highest running total of live bytes c10's CPU allocator reports, minus the total
before the model was built; the table shows the largest rank's. The estimate is
``estimate_memory`` for the same layout in fp32 with the CPU's single-tensor AdamW.

Run: ``python benchmarks/plan_memory.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from meshyard.plan.measure import MemoryProbe, measure_peak_memory
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import describe_gpt


def probes() -> list[MemoryProbe]:
    out = []
    for preset, micro_batch in (("gpt-tiny", 8), ("gpt-small", 4)):
        out.append(MemoryProbe(preset, "none", 1, micro_batch))
        out.append(MemoryProbe(preset, "none", 1, micro_batch, checkpoint=True))
        for strategy in ("ddp", "zero1", "fsdp", "fsdp-zero2", "tp"):
            out.append(MemoryProbe(preset, strategy, 2, micro_batch))
        out.append(MemoryProbe(preset, "fsdp", 2, micro_batch, checkpoint=True))
    # A vocabulary large enough for the loss to dominate, with the plain and the fused loss.
    out.append(MemoryProbe("gpt-tiny", "none", 1, 8, vocab_size=4096))
    out.append(MemoryProbe("gpt-tiny", "none", 1, 8, vocab_size=4096, fused_loss=True))
    return out


def main() -> None:
    chosen = probes()
    start = time.perf_counter()
    results = measure_peak_memory(chosen)
    elapsed = time.perf_counter() - start
    table = Table(title=f"Peak memory per rank: measured on CPU vs estimated ({elapsed:.0f} s)")
    for name in ("probe", "measured (per rank)", "estimated", "estimate / max measured", "estimated peak at"):
        table.add_column(name, justify="left" if name in ("probe", "estimated peak at") else "right")
    worst = 0.0
    for probe, ranks in zip(chosen, results):
        estimate = estimate_memory(describe_gpt(probe.shape()), probe.layout(), on_gpu=False)
        peak = max(rank.peak_bytes for rank in ranks)
        ratio = estimate.peak_bytes / peak
        worst = max(worst, abs(ratio - 1))
        per_rank = " / ".join(f"{rank.peak_bytes / 1e6:.2f}" for rank in ranks)
        table.add_row(probe.label(), f"{per_rank} MB", f"{estimate.peak_bytes / 1e6:.2f} MB", f"{ratio:.3f}",
                      estimate.peak_moment)
    console = Console(width=140)
    console.print(table)
    console.print(f"Largest deviation: {worst:.1%} (acceptance: 15%).")


if __name__ == "__main__":
    main()
