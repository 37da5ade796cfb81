"""Memory figures read every step."""

from __future__ import annotations

import torch

from meshyard.metrics.memory import MemoryProbe


def test_memory_probe_reads_the_current_resident_set_every_time():
    probe = MemoryProbe(torch.device("cpu"))
    before = probe.read()["rss_bytes"]
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    after = probe.read()["rss_bytes"]
    del block
    freed = probe.read()["rss_bytes"]
    assert after - before > 48 * 1024 * 1024
    assert after - freed > 48 * 1024 * 1024  # read again, not a cached figure
    # The kernel updates the high-water mark lazily (per page-table scan): allow a page batch.
    assert probe.read()["peak_rss_bytes"] >= after - 4 * 1024 * 1024
