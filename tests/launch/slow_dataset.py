"""The recording dataset, slowed down (a few ms per training sample) so that a test can
act while a job of a few dozen steps is still running; ``build_until_joined`` holds a job
back until it runs on every rank a test expects, so a joining host always arrives before
the end, however long it takes to start."""

from __future__ import annotations

import os
import time

from torch.utils.data import Dataset

from tests.checkpoint.recording_dataset import build as build_recording

SECONDS_PER_SAMPLE = 0.008


class Slow(Dataset):
    def __init__(self, inner: Dataset, seconds_per_sample: float = SECONDS_PER_SAMPLE) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.seconds_per_sample = seconds_per_sample

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        time.sleep(self.seconds_per_sample)
        return self.inner[index]


def build(split: str, seq_len: int, config) -> Dataset:
    inner = build_recording(split, seq_len, config)
    return Slow(inner) if split == "train" else inner


FULL_WORLD_SIZE = 4
SECONDS_PER_SAMPLE_UNTIL_JOINED = 0.1


def build_until_joined(split: str, seq_len: int, config) -> Dataset:
    """Slow while the job runs on fewer than ``FULL_WORLD_SIZE`` ranks (about a second a
    step with 8 samples a rank), at full speed on all of them (a test that acts on the
    full job at a step, losing a host, still has dozens of steps left to do it in)."""
    inner = build_recording(split, seq_len, config)
    joined = int(os.environ.get("WORLD_SIZE", "1")) >= FULL_WORLD_SIZE
    return inner if split != "train" or joined else Slow(inner, SECONDS_PER_SAMPLE_UNTIL_JOINED)
