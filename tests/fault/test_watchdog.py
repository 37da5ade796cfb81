from __future__ import annotations

import json
import time

import torch.distributed as dist

from meshyard.fault.watchdog import COLLECTIVE_OF_PHASE, WATCHED_POSITIONS, HangWatchdog, hang_message, laggards


def test_watched_positions_follow_the_step_phases():
    """The step's timed phases in their order (exposed communication is not a place; the
    step's blocking collective is "sync"), between start-up and the events after a step."""
    assert WATCHED_POSITIONS == ("starting", "data", "forward", "backward", "optimizer", "sync", "eval",
                                 "checkpoint", "finished")
    assert set(COLLECTIVE_OF_PHASE) <= set(WATCHED_POSITIONS)


def test_laggards_are_the_earliest_ranks():
    positions = {0: {"step": 5, "phase": "backward"}, 1: {"step": 5, "phase": "forward"},
                 2: {"step": 5, "phase": "backward"}}
    assert laggards(positions) == [1]
    assert laggards({0: {"step": 6, "phase": "data"}, 1: {"step": 5, "phase": "sync"}}) == [1]
    assert laggards({0: {"step": 5, "phase": "sync"}, 1: {"step": 5, "phase": "sync"}}) == []


def test_fires_once_after_the_timeout_and_not_while_progressing(tmp_path):
    store = dist.HashStore()
    messages: list[str] = []
    # Steps 0.1 s apart against a 2 s timeout: a loaded machine that holds this thread back
    # for a second still shows progress.
    dog = HangWatchdog(tmp_path, 0, 1, store, timeout_s=2.0, abort=False, report=messages.append,
                       hosts=["node1 (10.0.0.1)"])
    try:
        for step in range(1, 8):  # steady progress: no alarm
            dog.at("forward", step)
            time.sleep(0.1)
        assert not dog.fired
        deadline = time.monotonic() + 30
        while not dog.fired and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)  # more than a timeout after the alarm: still one message
        assert dog.fired and len(messages) == 1
        assert "every rank is at step 7, phase forward" in messages[0]
        report = json.loads((tmp_path / "hang" / "report-rank0.json").read_text())
        assert report["positions"]["0"]["step"] == 7
        assert report["host"] == "node1 (10.0.0.1)" and report["hosts"] == ["node1 (10.0.0.1)"]
        stacks = (tmp_path / "hang" / "rank0.txt").read_text()
        assert stacks.startswith("rank 0 on node1 (10.0.0.1) made no progress for ")
        assert "test_fires_once" in stacks  # the main thread's stack
    finally:
        dog.stop()


def _report(behind: list[int], missing: list[int], hosts: list[str]) -> dict:
    positions = {0: {"step": 5, "phase": "backward"}, 1: {"step": 5, "phase": "forward"},
                 2: {"step": 5, "phase": "backward"}}
    return {"stalled_s": 31.0, "step": 5, "phase": "backward", "behind": behind, "missing": missing,
            "positions": {r: p for r, p in positions.items() if r not in missing}, "hosts": hosts,
            "others_wait_in": [COLLECTIVE_OF_PHASE["backward"]]}


def test_hang_message_names_the_hosts_of_ranks_behind_and_of_silent_ones():
    """Hosts sharing a hostname are told apart by their address."""
    hosts = ["node (10.0.0.1)", "node (10.0.0.2)", "node (10.0.0.1)", "node (10.0.0.3)"]
    assert hang_message(_report([1], [3], hosts)) == (
        "hang: no progress for 31s; the other ranks wait in gradient all-reduce / reduce-scatter for rank 1 on "
        "node (10.0.0.2) (step 5, forward); no position ever came from rank 3 on node (10.0.0.3)")
    assert hang_message(_report([], [1], hosts)) == (
        "hang: no progress for 31s; every rank heard from is at step 5, phase backward (a collective that never "
        "completes); no position ever came from rank 1 on node (10.0.0.2)")
    # Hosts not gathered: ranks alone, as before.
    assert "for rank 1 (step 5, forward)" in hang_message(_report([1], [], []))


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_startup_has_its_own_longer_timeout(tmp_path):
    messages: list[str] = []
    dog = HangWatchdog(tmp_path, 0, 1, dist.HashStore(), timeout_s=0.3, abort=False, report=messages.append,
                       startup_timeout_s=30)
    try:
        time.sleep(1.5)  # five step timeouts of start-up: within its own allowance
        assert not dog.fired and messages == []
        dog.at("data", 1)  # the first step: from here the step timeout applies
        _wait_for(lambda: messages, 5)
        assert "every rank is at step 1, phase data" in messages[0]
    finally:
        dog.stop()


def test_startup_over_its_timeout_is_reported_and_steps_are_still_watched(tmp_path):
    messages: list[str] = []
    dog = HangWatchdog(tmp_path, 0, 1, dist.HashStore(), timeout_s=0.3, abort=False, report=messages.append,
                       startup_timeout_s=0.5)
    try:
        _wait_for(lambda: messages, 5)
        assert "start-up" in messages[0] and "fault.startup_timeout_s = 0.5" in messages[0]
        report = json.loads((tmp_path / "hang" / "report-rank0.json").read_text())
        assert report["phase"] == "starting" and report["timeout_s"] == 0.5
        dog.at("forward", 1)  # start-up finished late: a later stall is a hang of its own
        _wait_for(lambda: len(messages) > 1, 5)
        assert len(messages) == 2 and "every rank is at step 1, phase forward" in messages[1]
    finally:
        dog.stop()


def test_slow_startup_of_a_run_is_not_a_hang_but_a_stalled_step_is(tmp_path):
    """Through a whole (one-process) run: a model builder twice as slow as the step
    timeout, then a forward that stalls past it."""
    import meshyard
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "--model.name=tests/fault/faulty_plugins.py:build_model",
                      "--model.options={ rank = 0, build_sleep_s = 3, hang_at = 2, hang_s = 4 }", "--train.steps=3",
                      "--fault.hang_timeout_s=1.5", "--fault.startup_timeout_s=60")
    meshyard.run(cfg, nproc=1)
    report = json.loads((tmp_path / "run" / "hang" / "report-rank0.json").read_text())
    assert (report["step"], report["phase"], report["timeout_s"]) == (2, "forward", 1.5)
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "every rank is at step 2, phase forward" in log and "start-up" not in log


def test_startup_past_its_timeout_in_a_run_is_reported(tmp_path):
    import meshyard
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, "--model.name=tests/fault/faulty_plugins.py:build_model",
                      "--model.options={ build_sleep_s = 4 }", "--train.steps=1", "--fault.startup_timeout_s=1")
    meshyard.run(cfg, nproc=1)
    report = json.loads((tmp_path / "run" / "hang" / "report-rank0.json").read_text())
    assert report["phase"] == "starting" and report["step"] == 0
    assert "fault.startup_timeout_s = 1;" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
