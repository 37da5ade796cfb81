"""The CPU peak behind MFU: the fastest matmul call, so a training step cannot beat it."""

from __future__ import annotations

import time

import pytest
import torch

from meshyard.metrics import throughput
from meshyard.metrics.meter import StepMeter
from meshyard.metrics.memory import MemoryProbe
from meshyard.metrics.throughput import fastest_call, measured_cpu_peak
from meshyard.metrics.timing import NullStepTimer


class FakeTime:
    """Clocks that move only when the timed call runs: by the next of ``durations`` of CPU
    time, and by that plus the next of ``stolen`` (time the core ran something else) of
    wall-clock time."""

    def __init__(self, durations: list[float], stolen: list[float] | None = None) -> None:
        self.cpu = self.wall = 0.0
        self.durations = durations
        self.stolen = stolen or [0.0]
        self.calls = 0

    def cpu_clock(self) -> float:
        return self.cpu

    def wall_clock(self) -> float:
        return self.wall

    def call(self) -> None:
        busy = self.durations[self.calls % len(self.durations)]
        self.cpu += busy
        self.wall += busy + self.stolen[self.calls % len(self.stolen)]
        self.calls += 1


def test_fastest_call_is_the_shortest_not_the_mean():
    fake = FakeTime([0.5, 0.04, 0.01, 0.2, 0.03])
    assert fastest_call(fake.call, 0.7, clock=fake.cpu_clock, wall_clock=fake.wall_clock) == pytest.approx(0.01)
    assert fake.calls >= 4  # one warm-up call, then calls until the time is up


def test_time_a_core_was_taken_away_does_not_count():
    # Every call loses its core for a while; the wall clock sees it, CPU time does not.
    fake = FakeTime([0.02, 0.01, 0.03], stolen=[0.05, 0.08])
    assert fastest_call(fake.call, 0.5, clock=fake.cpu_clock, wall_clock=fake.wall_clock) == pytest.approx(0.01)


def test_fastest_call_times_a_few_calls_even_without_time():
    fake = FakeTime([0.3, 0.2, 0.1, 0.4])
    fastest = fastest_call(fake.call, 0.0, least_calls=3, clock=fake.cpu_clock, wall_clock=fake.wall_clock)
    assert fastest == pytest.approx(0.1)
    assert fake.calls == 4  # the warm-up call and three timed ones


def test_peak_is_the_best_shape(monkeypatch):
    seconds = iter([2e-3, 1e-2])  # the second shape is slower per FLOP
    monkeypatch.setattr(throughput, "fastest_call", lambda call, limit: next(seconds))
    peak = measured_cpu_peak(shapes=((100, 100, 100), (200, 200, 200)))
    assert peak == pytest.approx(max(2e6 / 2e-3, 16e6 / 1e-2))


def test_steady_matmul_work_stays_under_the_measured_peak():
    """MFU of a step that does nothing but matmuls of the measured shape, timed by the
    wall clock as the meter times a step: it must read below 100 %."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs
    try:
        peak = measured_cpu_peak(shapes=((256, 256, 256),), seconds_per_shape=0.1)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        calls, flops_per_call = 20, 2.0 * 256**3
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        step_time = time.perf_counter() - start
        # A probe that a busy machine slowed throughout reads low; a second one after the
        # step makes both readings of the peak taken under a load the step did not see rare.
        peak = max(peak, measured_cpu_peak(shapes=((256, 256, 256),), seconds_per_shape=0.1))
    finally:
        torch.set_num_threads(threads)
    meter = StepMeter(NullStepTimer(), MemoryProbe(torch.device("cpu")), None, flops_per_call, peak, 1)
    assert 0 < meter.finish_step(step_time, calls)["mfu"] < 1.1
