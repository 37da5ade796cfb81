"""What a run writes to its directory: metrics.jsonl (rank 0) and one log file per rank."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TextIO


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most a line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class NullWriter:
    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """A logger writing to ``<run_dir>/logs/rank<N>.log`` (and nowhere else)."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"meshyard.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
    handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    logger.addHandler(handler)
    return logger


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a run, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
