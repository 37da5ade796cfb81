"""Batches bound for a GPU are collated into pinned memory; CPU runs do not pin."""

from __future__ import annotations

import pytest
import torch

from meshyard.config.load import load_config
from meshyard.data.loader import build_data, pins_memory


def test_only_cuda_batches_are_pinned():
    assert pins_memory(torch.device("cuda", 0))
    assert not pins_memory(torch.device("cpu"))
    assert not pins_memory(None)


@pytest.mark.parametrize("device, pinned",
                         [(torch.device("cuda", 1), True), (torch.device("cpu"), False), (None, False)])
def test_loader_follows_the_device(tmp_path, device, pinned):
    cfg = load_config(None, [f"--data.cache_dir={tmp_path}", "--data.source=random", "--data.random_tokens=4096",
                             "--data.seq_len=16"]).data
    bundle = build_data(cfg, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, seed=0, device=device)
    assert bundle.train_loader.pin_memory is pinned
