"""The elastic agent behind ``launch_local``: workers that exit for a preemption are not
restarted, workers that fail are, as often as ``max_restarts`` allows.

The workers are a plain function of this module (started with the spawn method, as
meshyard's are); each leaves a file per attempt, so the test counts how often it ran.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from meshyard.fault.failure import WorkerFailure
from meshyard.fault.preemption import EXIT_PREEMPTED
from meshyard.launch.local import launch_local

NPROC = 2
STARTUP_WAIT_S = 120  # the longest a worker waits for the others of its attempt to start


def exit_with(folder: str, code: int) -> None:
    """Note this attempt of this rank, wait until every local rank of the attempt has
    noted it (the agent stops the others once one exits: each must have run first),
    then exit with ``code``."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    Path(folder, f"attempt{attempt}-rank{os.environ['LOCAL_RANK']}").touch()
    deadline = time.monotonic() + STARTUP_WAIT_S
    while len(list(Path(folder).glob(f"attempt{attempt}-*"))) < NPROC and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(code)


def _runs(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_preempted_workers_are_not_restarted(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        launch_local(exit_with, (str(tmp_path), EXIT_PREEMPTED), NPROC, max_restarts=2, grace_period_s=5)
    assert _runs(tmp_path) == ["attempt0-rank0", "attempt0-rank1"]
    assert info.value.exit_codes == [EXIT_PREEMPTED] * NPROC


def test_failed_workers_are_restarted_as_often_as_max_restarts_allows(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        launch_local(exit_with, (str(tmp_path), 1), NPROC, max_restarts=1, grace_period_s=5)
    assert _runs(tmp_path) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    assert 1 in info.value.exit_codes and EXIT_PREEMPTED not in info.value.exit_codes
    assert "exited with code 1" in str(info.value)  # the paragraph tells how the rank ended
