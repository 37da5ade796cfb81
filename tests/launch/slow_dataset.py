"""The recording dataset, slowed down (a few ms per training sample) so that a test can
act while a job of a few dozen steps is still running."""

from __future__ import annotations

import time

from torch.utils.data import Dataset

from tests.checkpoint.recording_dataset import build as build_recording

SECONDS_PER_SAMPLE = 0.008


class Slow(Dataset):
    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        time.sleep(SECONDS_PER_SAMPLE)
        return self.inner[index]


def build(split: str, seq_len: int, config) -> Dataset:
    inner = build_recording(split, seq_len, config)
    return Slow(inner) if split == "train" else inner
