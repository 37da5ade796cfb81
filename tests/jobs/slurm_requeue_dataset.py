"""The recording dataset for a Slurm job that a test signals and that requeues itself:
slow in the job's first run, without delay once requeued.

The first run is signalled after its first steps and must still be training when the
signal arrives, however long Slurm and the launcher take to pass it on: at half a second
a step it needs tens of seconds for a few dozen steps, whatever the load. The requeued
run (``SLURM_RESTART_COUNT`` set) only has to finish, and does so in a few seconds.
"""

from __future__ import annotations

import os

from torch.utils.data import Dataset

from tests.checkpoint.recording_dataset import build as build_recording
from tests.launch.slow_dataset import Slow

# Two samples per rank and step in the test's job: half a second a step.
FIRST_RUN_SECONDS_PER_SAMPLE = 0.25


def build(split: str, seq_len: int, config) -> Dataset:
    inner = build_recording(split, seq_len, config)
    requeued = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    if split != "train" or requeued:
        return inner
    return Slow(inner, FIRST_RUN_SECONDS_PER_SAMPLE)
