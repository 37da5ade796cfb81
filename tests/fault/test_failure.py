"""A failed rank in one paragraph: the place in the user's code, the first line of the
message, and the earliest failure of the attempt when several ranks fail."""

from __future__ import annotations

import json
import pickle
import time

from pathlib import Path

import pytest
import torch

from meshyard.fault.failure import (RankFailed, WorkerFailure, describe, first_failure, first_line, record_bad_input,
                                    record_failure, recorded_bad_input)


def _shapes_clash() -> torch.Tensor:
    return torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5))  # raises inside torch


def raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_the_place_named_is_the_innermost_frame_outside_torch():
    exc = raised(_shapes_clash)
    text = describe(exc)
    line = _shapes_clash.__code__.co_firstlineno + 1
    assert text.startswith("RuntimeError: ") and text.endswith(f"(at test_failure.py:{line} in _shapes_clash)"), text


def test_the_message_is_cut_to_its_first_line():
    assert first_line("\n\nfirst\nsecond") == "first ..."
    assert first_line("x" * 300, limit=10) == "x" * 10 + " ..."
    assert first_line("") == "" and first_line("one") == "one"
    assert describe(ValueError()) == "ValueError"  # no message, never raised: no place


def test_record_failure_keeps_the_traceback_in_the_rank_log(tmp_path, monkeypatch):
    exc = raised(_shapes_clash)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    failure = record_failure(exc, 3, tmp_path)
    assert isinstance(failure, RankFailed) and isinstance(failure, WorkerFailure) and failure.exit_codes == [1]
    log = tmp_path / "logs" / "rank3.log"
    assert str(failure) == f"rank 3 failed: {describe(exc)}; full traceback in {log}"
    assert "Traceback (most recent call last)" in log.read_text() and "_shapes_clash" in log.read_text()
    record = json.loads((tmp_path / "logs" / "failures" / "restart1-rank3.json").read_text())
    assert (record["rank"], record["job"], record["restart"]) == (3, "job-a", 1)
    again = pickle.loads(pickle.dumps(failure))
    assert (type(again), str(again), again.rank, again.log) == (RankFailed, str(failure), 3, log)


def test_without_a_run_directory_the_traceback_goes_to_stderr(capsys):
    failure = record_failure(raised(_shapes_clash), 0, None)
    assert "full traceback" not in str(failure) and failure.log is None
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def write_record(run_dir, rank: int, at: float, job: str = "job-a", restart: int = 0) -> None:
    (run_dir / "logs" / "failures").mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "time": at, "job": job, "restart": restart, "summary": f"rank {rank} failed: X",
              "log": f"rank{rank}.log"}
    (run_dir / "logs" / "failures" / f"restart{restart}-rank{rank}.json").write_text(json.dumps(record))


def test_the_earliest_failure_of_the_attempt_is_reported(tmp_path):
    """The agent may notice rank 0 first, which failed after losing rank 1 in a collective."""
    write_record(tmp_path, 0, 2.0)
    write_record(tmp_path, 1, 1.0)
    write_record(tmp_path, 2, 0.5, restart=1)  # a later attempt
    write_record(tmp_path, 1, 0.7, restart=1)  # rank 1 failed again: both records are kept
    write_record(tmp_path, 3, 0.1, job="job-b")  # an earlier launch into the same run directory
    assert first_failure(tmp_path, "job-a", 0) == "rank 1 failed: X; full traceback in rank1.log"
    assert first_failure(tmp_path, "job-a", 1) == "rank 2 failed: X; full traceback in rank2.log"
    assert first_failure(tmp_path, "job-b", 0) == "rank 3 failed: X; full traceback in rank3.log"
    assert first_failure(tmp_path, "job-a", 2) is None  # no rank of it raised: killed, or exited on purpose


def test_installed_packages_inside_pythons_folder_are_named(monkeypatch):
    """As on Docker images: site-packages inside the standard library's folder. A frame of
    an installed package (meshyard, the user's) is named; Python's and torch's are not."""
    import sysconfig

    import torch

    from meshyard.fault.failure import _is_library

    lib = "/usr/local/lib/python3.11"
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": lib, "platstdlib": lib,
                                                          "purelib": f"{lib}/site-packages",
                                                          "platlib": f"{lib}/site-packages"})
    assert not _is_library(f"{lib}/site-packages/meshyard/train/trainer.py")
    assert not _is_library(f"{lib}/site-packages/mymodels/gpt.py")
    assert _is_library(f"{lib}/json/decoder.py")
    assert _is_library(str(Path(torch.__file__).parent / "nn" / "modules" / "module.py"))
    assert _is_library("<eval_with_key>.3")


def test_failures_of_an_earlier_launch_with_the_same_job_id_are_not_reported(tmp_path):
    """A rendezvous or scheduler id outlives a launch: its records are told apart by time."""
    write_record(tmp_path, 1, 10.0)  # the earlier launch, fixed since
    write_record(tmp_path, 0, 50.0)
    assert first_failure(tmp_path, "job-a", 0, since=40.0) == "rank 0 failed: X; full traceback in rank0.log"
    assert first_failure(tmp_path, "job-a", 0, since=60.0) is None


def test_a_workers_bad_input_is_kept_for_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    record_bad_input(["checkpoint.dir is not shared"], "checkpoint storage", 1, tmp_path)
    assert recorded_bad_input(tmp_path, "job-a") == (["checkpoint.dir is not shared"], "checkpoint storage")
    assert recorded_bad_input(tmp_path, "job-b") is None
    assert recorded_bad_input(tmp_path, "job-a", since=time.time() + 60) is None
