from __future__ import annotations

import json
import time

import torch.distributed as dist

from meshyard.fault.watchdog import HangWatchdog, laggards


def test_laggards_are_the_earliest_ranks():
    positions = {0: {"step": 5, "phase": "backward"}, 1: {"step": 5, "phase": "forward"},
                 2: {"step": 5, "phase": "backward"}}
    assert laggards(positions) == [1]
    assert laggards({0: {"step": 6, "phase": "data"}, 1: {"step": 5, "phase": "sync"}}) == [1]
    assert laggards({0: {"step": 5, "phase": "sync"}, 1: {"step": 5, "phase": "sync"}}) == []


def test_fires_once_after_the_timeout_and_not_while_progressing(tmp_path):
    store = dist.HashStore()
    messages: list[str] = []
    dog = HangWatchdog(tmp_path, 0, 1, store, timeout_s=0.5, abort=False, report=messages.append)
    try:
        for step in range(1, 8):  # steady progress: no alarm
            dog.at("forward", step)
            time.sleep(0.1)
        assert not dog.fired
        time.sleep(3.5)
        assert dog.fired and len(messages) == 1
        assert "every rank is at step 7, phase forward" in messages[0]
        report = json.loads((tmp_path / "hang" / "report-rank0.json").read_text())
        assert report["positions"]["0"]["step"] == 7
        assert "test_fires_once" in (tmp_path / "hang" / "rank0.txt").read_text()  # the main thread's stack
    finally:
        dog.stop()
