"""Idle GPU, data stalls and exposed communication as shares of paid time, and their live flags."""

from __future__ import annotations

import pytest

from meshyard.config.sections import MetricsConfig
from meshyard.metrics.console import ProgressDisplay
from meshyard.metrics.waste import DATA_STALL, EXPOSED_COMM, IDLE_GPU, WasteWatch, find_waste, idle_seconds


def record(step: int, util: float | None = None, data: float = 0.125, comm: float = 0.0625,
           **extra: float) -> dict:
    figures = {"step": step, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": 0.5,
               "data_time_s": data, "data_s": data, "comm_s": comm, **extra}
    if util is not None:
        figures["gpu_utilization_pct"] = util
    return figures


# NVML is read on some steps only: a reading holds until the next. Steps 5-8 are idle (a span
# of 4), step 10 dips alone (shorter than the span of 3 asked for, so not counted).
READINGS = {1: 90.0, 5: 10.0, 9: 80.0, 10: 20.0}


def test_each_waste_is_its_share_of_paid_time_and_of_the_cost():
    records = [record(step, READINGS.get(step), cost_per_step_usd=0.25) for step in range(1, 11)]
    waste = {w.kind: w for w in find_waste(records, MetricsConfig(idle_span_steps=3))}
    assert list(waste) == [IDLE_GPU, DATA_STALL, EXPOSED_COMM]
    assert all(w.paid_s == pytest.approx(5.0) and w.steps == 10 for w in waste.values())
    assert waste[IDLE_GPU].fraction == pytest.approx(0.4) and waste[IDLE_GPU].flagged
    assert waste[IDLE_GPU].wasted_usd == pytest.approx(1.0)
    assert waste[DATA_STALL].fraction == pytest.approx(0.25) and waste[DATA_STALL].flagged  # threshold 0.2
    assert waste[DATA_STALL].wasted_usd == pytest.approx(0.625)
    assert waste[EXPOSED_COMM].fraction == pytest.approx(0.125) and not waste[EXPOSED_COMM].flagged  # 0.25
    assert waste[IDLE_GPU].flag() == "idle GPU 40% of last 10 steps"


def test_idle_spans_need_readings_and_enough_steps_in_a_row():
    records = [record(step, READINGS.get(step)) for step in range(1, 11)]
    assert idle_seconds(records, threshold=0.5, span_steps=5) == 0.0  # the span of 4 is too short
    assert idle_seconds(records, threshold=0.5, span_steps=1) == pytest.approx(2.5)  # step 10 counts too
    assert idle_seconds([record(1), record(2)], threshold=0.5, span_steps=1) is None  # a CPU run


def test_no_money_without_a_cost_and_no_comm_without_the_breakdown():
    plain = [{k: v for k, v in record(step).items() if k not in ("data_s", "comm_s")} for step in (1, 2)]
    waste = find_waste(plain, MetricsConfig())
    assert [(w.kind, w.fraction, w.wasted_usd) for w in waste] == [(DATA_STALL, 0.25, None)]  # from data_time_s


def progress_lines(capsys, util: float, data: float) -> list[str]:
    watch = WasteWatch(MetricsConfig(waste_window=10, idle_span_steps=5))
    display = ProgressDisplay(total_steps=100, log_every=10, use_bar=False, waste=watch)
    for step in range(1, 21):
        display.update(record(step, util, data=data, comm=0.0))
    return capsys.readouterr().out.splitlines()


def test_progress_flags_an_idle_window_at_the_log_interval(capsys):
    first, tenth, twentieth = progress_lines(capsys, util=5.0, data=0.01)
    assert "waste" not in first  # judged every log_every steps only
    assert tenth.endswith("waste: idle GPU 100% of last 10 steps") and twentieth.endswith(tenth[-40:])


def test_progress_flags_a_data_stall_and_not_a_busy_window(capsys):
    assert progress_lines(capsys, util=95.0, data=0.15)[1].endswith("waste: data stall 30% of last 10 steps")
    assert not any("waste" in line for line in progress_lines(capsys, util=95.0, data=0.01))
