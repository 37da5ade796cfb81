"""A test-only data source: the 'shards' source's training windows, recording every
micro-batch a process reads and reading through a store made slow and unreliable.

``data.cache_dir``'s ``seen`` folder receives ``<rank>-<pid>.txt`` (one line of sample
indices per micro-batch, in the order read) and ``<rank>-<pid>.failed`` (one line per
injected failure). Each shard fetch takes 5 ms longer, and the first fetch of every
third shard in each process fails with a connection error (the cache tries again).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from meshyard.config.sections import DataConfig
from meshyard.data.loader import TokenWindows, split_corpus

SLOWER_S = 0.005


class RecordingWindows(TokenWindows):
    def __init__(self, windows: TokenWindows, record: Path) -> None:
        super().__init__(windows.tokens, windows.seq_len, windows.first, windows.count)
        self.record = record

    def __getitems__(self, indices: list[int]):
        with self.record.open("a") as out:
            out.write(" ".join(map(str, indices)) + "\n")
        return super().__getitems__(indices)


def seen_folder(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir) / "seen"


def _unreliable(store, failures: Path) -> None:
    read, failed = store.read, set()

    def slow_and_failing(name: str) -> bytes:
        time.sleep(SLOWER_S)
        if name.startswith("shard-") and int(name[6:11]) % 3 == 0 and name not in failed:
            failed.add(name)
            with failures.open("a") as out:
                out.write(name + "\n")
            raise ConnectionError(f"injected: connection reset while fetching {name}")
        return read(name)
    store.read = slow_and_failing


def build(split: str, config: DataConfig):
    if split != "train":
        return None
    train = split_corpus(replace(config, source="shards")).train
    folder = seen_folder(config)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{os.environ.get('RANK', '0')}-{os.getpid()}"
    _unreliable(train.tokens.cache.store, folder / f"{name}.failed")
    recording = RecordingWindows(train, folder / f"{name}.txt")
    recording.vocab_size = 256  # byte tokens
    return recording


def read_batches(folder: Path, rank: int | None = None) -> list[list[int]]:
    """The micro-batches recorded (of one rank, or of all), file by file in name order."""
    files = sorted(folder.glob("*.txt" if rank is None else f"{rank}-*.txt"))
    return [list(map(int, line.split())) for f in files for line in f.read_text().splitlines()]
