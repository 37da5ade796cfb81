"""A failed rank, told in one paragraph; its full traceback goes to the rank's log.

What the console shows of a failure, whichever way the rank was started (a local
worker, the launching process itself, a rank under torchrun, Slurm or Kubeflow)::

    rank 1 failed: ValueError: heads do not divide (at model.py:42 in forward); full traceback in <run>/logs/rank1.log

The place named is the innermost frame of the user's code or meshyard's: torch's and
Python's own frames say where an error surfaced, rarely what to change. The message is
cut to its first line: some exceptions carry a whole module's repr.

Several ranks of a job often fail together, and only one of them for the real reason:
the others lose a peer in a collective and fail after it. Each failing rank therefore
also writes a small record (``logs/failures/restart<N>-rank<R>.json``) with the time
it failed, and the launcher reports the earliest of the last attempt (``first_failure``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

from meshyard.fault.watchdog import EXIT_HUNG
from meshyard.run_dir import RunDir

FIRST_LINE_CHARS = 240
# Exit codes meshyard's own code gives a rank on purpose, and what each means.
EXIT_MEANINGS = {EXIT_HUNG: "stopped by the hang watchdog, which says why in the rank's log"}


class WorkerFailure(RuntimeError):
    """A worker exited with an error; the message names the rank and the cause."""

    def __init__(self, message: str, exit_codes: list[int]) -> None:
        super().__init__(message)
        self.exit_codes = exit_codes

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its own arguments (across processes)
        return type(self), (str(self), self.exit_codes)


class RankFailed(WorkerFailure):
    """This rank raised an exception: ``str`` is the paragraph the console shows, the
    exception itself is the ``__cause__``, and ``log`` holds the full traceback."""

    def __init__(self, rank: int, summary: str, log: Path | None) -> None:
        super().__init__(summary, [1])
        self.rank, self.log = rank, log

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.rank, str(self), self.log)


def _folders(*paths: str) -> tuple[str, ...]:
    return tuple(path.rstrip("/") + "/" for path in paths)


def _is_library(filename: str) -> bool:
    """Whether a frame in ``filename`` is never the place to name: generated code (a traced
    graph's), torch's, or Python's own. Installed packages (meshyard, the user's) are
    not, even where site-packages lies inside Python's folder (Docker images, conda)."""
    if filename.startswith("<"):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None) and filename.startswith(
            _folders(str(Path(torch.__file__).parent))):
        return True
    paths = sysconfig.get_paths()
    python, installed = _folders(paths["stdlib"], paths["platstdlib"]), _folders(paths["purelib"], paths["platlib"])
    return filename.startswith(python) and not filename.startswith(installed)


def failure_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in code of the user's or meshyard's
    (not Python's, not torch's, not generated code such as a traced graph's); the
    innermost frame of all when there is none."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not _is_library(frame.filename):
            return frame
    return frames[-1] if frames else None


def first_line(message: str, limit: int = FIRST_LINE_CHARS) -> str:
    """The first non-empty line of ``message``, cut to ``limit`` characters; ' ...' marks
    what was left out."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[0]
    if len(line) > limit:
        return line[:limit].rstrip() + " ..."
    return line + (" ..." if len(lines) > 1 else "")


def describe(exc: BaseException) -> str:
    """``Type: first line of the message (at file.py:LINE in function)``."""
    text = first_line(str(exc))
    frame = failure_frame(exc)
    where = f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})" if frame else ""
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where a rank logs (``metrics.records.rank_logger`` writes the same file)."""
    return RunDir(run_dir).rank_log(rank)


def this_attempt() -> tuple[str, int]:
    """This process's elastic job id and restart count (the local agent and torchrun set
    both; a process started otherwise is attempt ("", 0))."""
    return os.environ.get("TORCHELASTIC_RUN_ID", ""), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_failure(exc: BaseException, rank: int, run_dir: Path | None) -> RankFailed:
    """Write ``exc``'s full traceback to the rank's log and its failure record under
    ``run_dir`` (when known), and return the ``RankFailed`` to raise in its place."""
    log = rank_log(run_dir, rank) if run_dir is not None else None
    summary = f"rank {rank} failed: {describe(exc)}"
    if log is not None:
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with log.open("a") as out:
                out.write(f"{stamp} rank{rank} failed: {describe(exc)}\n{''.join(traceback.format_exception(exc))}")
            job, restart = this_attempt()
            record = {"rank": rank, "time": time.time(), "job": job, "restart": restart, "summary": summary,
                      "type": type(exc).__name__, "log": str(log)}
            _record_path(run_dir, restart, rank).parent.mkdir(exist_ok=True)
            _record_path(run_dir, restart, rank).write_text(json.dumps(record))
        except OSError:  # a full or read-only disk: the console still gets the paragraph
            log = None
    if log is None:
        # Nowhere to keep the traceback: it goes to this rank's stderr instead of being lost.
        traceback.print_exception(exc, file=sys.stderr)
    return RankFailed(rank, _paragraph(summary, log), log)


def _paragraph(summary: str, log: Path | str | None) -> str:
    return summary + (f"; full traceback in {log}" if log else "")


def _record_path(run_dir: Path, restart: int, rank: int) -> Path:
    """One record per rank and attempt (a launch into the same run directory replaces
    those of an earlier one, told apart by its job id)."""
    return RunDir(run_dir).failure_record(restart, rank)


def first_failure(run_dir: Path, job: str, restart: int, since: float = 0.0) -> str | None:
    """The paragraph of the earliest failure recorded under ``run_dir`` in attempt
    ``restart`` of elastic job ``job``, at ``since`` or later (a job id that outlives a
    launch, such as a rendezvous id, must not bring back an earlier launch's failures);
    None when no rank of it raised (they were killed, or exited on purpose)."""
    earliest = _earliest_record(RunDir(run_dir).failure_records(restart), job, since, ("summary", "log"))
    return _paragraph(earliest["summary"], earliest["log"]) if earliest is not None else None


def _earliest_record(paths: list[Path], job: str, since: float, wanted: tuple[str, ...]) -> dict[str, Any] | None:
    """The earliest readable record among ``paths`` (under ``logs/failures``) of elastic
    job ``job`` made at ``since`` or later that holds the ``wanted`` keys."""
    records = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and all(key in record for key in ("time", *wanted)) \
                and record.get("job") == job and record["time"] >= since:
            records.append(record)
    return min(records, key=lambda record: record["time"]) if records else None


def exit_description(rank: int, exit_code: int, run_dir: Path | None) -> str:
    """A rank that ended without raising: killed by a signal, or exited with a code."""
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        what = f"rank {rank} was killed by {name}"
    else:
        what = f"rank {rank} exited with code {exit_code}"
        meaning = EXIT_MEANINGS.get(exit_code)
        what += f", {meaning}" if meaning else ""
    log = rank_log(run_dir, rank) if run_dir is not None else None
    return what + (f"; its log: {log}" if log is not None and log.exists() else "")


def _bad_input_path(run_dir: Path, rank: int) -> Path:
    return RunDir(run_dir).bad_input_record(rank)


def record_bad_input(problems: list[str], source: str, rank: int, run_dir: Path | None) -> None:
    """Keep a worker's ``ConfigError`` (its problems and where they were found) for the
    launcher, which raises it again so the console shows the whole message, exit code 2."""
    if run_dir is None:
        return
    job, restart = this_attempt()
    path = _bad_input_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"problems": problems, "source": source, "job": job, "restart": restart,
                                    "time": time.time()}))
    except OSError:  # the exit code still says bad input
        pass


def recorded_bad_input(run_dir: Path | None, job: str, since: float = 0.0) -> tuple[list[str], str] | None:
    """The problems and source of the earliest bad input a worker of elastic job ``job``
    recorded under ``run_dir`` at ``since`` or later, if any."""
    if run_dir is None:
        return None
    earliest = _earliest_record(RunDir(run_dir).bad_input_records(), job, since, ("problems", "source"))
    if earliest is None:
        return None
    return [str(problem) for problem in earliest["problems"]], str(earliest["source"])
