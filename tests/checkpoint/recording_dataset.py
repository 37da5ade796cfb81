"""A dataset that records every training sample it serves (for exactly-once checks).

Each serving process appends the indices it reads to ``<record dir>/<pid>.txt``; the
record directory is taken from ``data.cache_dir`` of the config it is given.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB = 64


class Recording(Dataset):
    vocab_size = VOCAB

    def __init__(self, count: int, seq_len: int, record_dir: Path | None) -> None:
        self.count, self.seq_len, self.record_dir = count, seq_len, record_dir

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record_dir is not None:
            with (self.record_dir / f"{os.getpid()}.txt").open("a") as handle:
                handle.write(f"{index}\n")
        g = torch.Generator().manual_seed(index)
        start = torch.randint(0, VOCAB, (1,), generator=g).item()
        seq = (torch.arange(self.seq_len + 1) * 3 + start) % VOCAB  # learnable: step 3 sequences
        return seq[:-1], seq[1:]


def build(split: str, seq_len: int, config) -> Dataset:
    record_dir = Path(config.cache_dir) if split == "train" else None
    if record_dir is not None:
        record_dir.mkdir(parents=True, exist_ok=True)
    return Recording(2048 if split == "train" else 64, seq_len, record_dir)


def seen_indices(record_dir: Path) -> list[int]:
    return [int(line) for f in sorted(record_dir.glob("*.txt")) for line in f.read_text().split()]
