"""Test-only datasets for the spike and NaN guard: a sequence any model learns in a few
steps (each token is the one before plus one), and the same with garbage (random
targets) in every sample of known global steps.

The poisoned samples are the whole stream steps ``POISONED_STEPS`` of a run with
``GLOBAL_BATCH`` and ``SEED`` (what the guard's tests configure), found with the
sampler's own order, so the guard should skip exactly them.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from meshyard.data.sampling import GlobalBatchSampler

VOCAB = 64
SAMPLES = 512
GLOBAL_BATCH = 8
SEED = 1234  # train.seed's default
POISONED_STEPS = (24, 25)  # 0-based stream steps: optimizer steps 25 and 26 of a run that skipped nothing


def poisoned_indices() -> list[int]:
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, GLOBAL_BATCH, 0, 1, SEED)
    return sorted(i for step in POISONED_STEPS for i in sampler.global_indices(step))


class Counting(Dataset):
    vocab_size = VOCAB

    def __init__(self, count: int, seq_len: int, poisoned: set[int]) -> None:
        self.count, self.seq_len, self.poisoned = count, seq_len, poisoned

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = (torch.arange(self.seq_len + 1) + index * 7) % VOCAB
        if index in self.poisoned:
            seq = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))
        return seq[:-1], seq[1:]


def clean(split: str, seq_len: int) -> Dataset:
    return Counting(SAMPLES if split == "train" else 32, seq_len, set())


def poisoned(split: str, seq_len: int) -> Dataset:
    poison = set(poisoned_indices()) if split == "train" else set()
    return Counting(SAMPLES if split == "train" else 32, seq_len, poison)
