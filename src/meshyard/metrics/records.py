"""What a run writes to its directory: metrics.jsonl (rank 0) and one log file per rank."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any, TextIO

from meshyard.run_dir import RunDir
from meshyard.runtime.hosts import host_of, rank_on_host


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most a line.

    The file is opened at the first write, after a resume has trimmed it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class NullWriter:
    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """A logger writing to ``<run_dir>/logs/rank<N>.log`` (and nowhere else)."""
    log_file = RunDir(run_dir).rank_log(rank)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"meshyard.rank{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s rank" + str(rank) + " %(message)s"))
    logger.addHandler(handler)
    return logger


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a run, in order."""
    path = RunDir(Path(run_dir)).metrics
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_new_metrics(run_dir: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int, bool]:
    """The step records written to metrics.jsonl from byte ``offset`` on, for a reader that
    follows a run while it trains: ``(records, next offset, restarted)``.

    A line still being written (no newline yet) waits for the next call. A file shorter
    than ``offset`` was trimmed by a resume (``truncate_metrics``): it is read again from
    the start and ``restarted`` says so, for the reader to drop what it had."""
    path = RunDir(Path(run_dir)).metrics
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            restarted = size < offset
            start = 0 if restarted else offset
            handle.seek(start)
            data = handle.read(size - start)
    except FileNotFoundError:  # the run has not recorded its first step yet
        return [], 0, offset > 0
    complete = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return records, start + len(complete), restarted


class Sinks:
    """Where step records go: the display, metrics.jsonl, the per-rank log, and optional
    exporters (Prometheus, TensorBoard) on rank 0."""

    def __init__(self, display: Any, writer: JsonlWriter | NullWriter, logger: logging.Logger,
                 exporters: list[Any] | None = None) -> None:
        self.display = display
        self.writer = writer
        self.logger = logger
        self.exporters = exporters or []
        self.step_times: list[float] = []

    def record_step(self, record: dict[str, Any], local_loss: float) -> None:
        self.step_times.append(record["step_time_s"])
        self.writer.write(record)
        for exporter in self.exporters:
            exporter.write(record)
        self.display.update(record)
        self.logger.info(
            "step %d local_loss %.6f step_time %.4fs data_time %.4fs",
            record["step"], local_loss, record["step_time_s"], record["data_time_s"],
        )
        if record.get("stragglers"):
            self.warn(straggler_message(record))

    def warn(self, message: str) -> None:
        self.logger.warning(message)
        self.display.note(f"meshyard: {message}")

    def close(self) -> None:
        self.writer.close()
        for exporter in self.exporters:
            exporter.close()


def straggler_message(record: dict[str, Any]) -> str:
    """One line naming a record's stragglers, each with its host when known:
    ``straggler at step 12: rank 3 on node1 (10.0.0.2), 80 ms busy; median of all ranks 40 ms``
    (the median stragglers are found against: ``metrics.ranks.find_stragglers``)."""
    busy = record["ranks"]["busy_s"]
    hosts = record.get("straggler_hosts", [])
    named = "; ".join(f"{rank_on_host(rank, host_of(hosts, index))}, {busy[rank] * 1000:.0f} ms busy"
                      for index, rank in enumerate(record["stragglers"]))
    return f"straggler at step {record['step']}: {named}; median of all ranks {statistics.median(busy) * 1000:.0f} ms"


def truncate_metrics(run_dir: Path, last_step: int) -> int:
    """Drop records after ``last_step`` (work a restart will redo); returns how many went."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(lines) - len(kept)
