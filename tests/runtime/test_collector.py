from __future__ import annotations

import gc

from meshyard.runtime.collector import CollectorClock, freeze_long_lived, thaw


def test_the_clock_adds_up_collections_in_any_thread_and_starts_again_after_take():
    import threading

    clock = CollectorClock()
    clock.install()
    try:
        assert clock.take() >= 0.0
        gc.collect()
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
        first = clock.take()
        assert first > 0.0
        assert clock.take() < first  # what was taken is not counted again
    finally:
        clock.remove()
    before = clock.take()
    gc.collect()
    assert clock.take() == before == 0.0  # removed: collections are no longer counted
    clock.remove()  # twice is harmless


def test_the_clock_is_installed_once():
    clock = CollectorClock()
    clock.install()
    clock.install()
    try:
        assert gc.callbacks.count(clock._on_collection) == 1
    finally:
        clock.remove()
    assert clock._on_collection not in gc.callbacks


def test_frozen_objects_stay_out_of_collections_until_thawed():
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only a collection frees it
    watch = weakref.ref(a)
    freeze_long_lived()
    try:
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert watch() is not None  # frozen: unreachable, yet never walked
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert watch() is None  # thawed: collected like any garbage


def test_a_collection_under_way_when_the_clock_was_installed_counts_nothing():
    clock = CollectorClock()
    clock._on_collection("stop", {"generation": 2})  # its "start" came before the clock
    assert clock.take() == 0.0
    clock._on_collection("start", {"generation": 0})
    clock._on_collection("stop", {"generation": 0})
    assert clock.take() > 0.0


def test_each_run_freezes_again_after_its_first_step(monkeypatch):
    from meshyard.runtime import collector
    from meshyard.runtime.collector import RunCollector

    freezes = []
    monkeypatch.setattr(collector, "freeze_long_lived", lambda: freezes.append(1))
    run = RunCollector()
    for _ in range(2):  # two fits of one trainer
        freezes.clear()
        run.start()
        try:
            for _ in range(3):
                run.step_settled()
        finally:
            run.stop()
        assert len(freezes) == 2  # at start and after the first step, not later
