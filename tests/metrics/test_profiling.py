"""metrics.profile_steps: torch.profiler over a window of steps, its table and trace in the
run directory, the window's records marked, and the doctor's steady steps without them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from meshyard.config.checks import field_problems
from meshyard.doctor.diagnose import steady_records
from meshyard.metrics.profiling import StepProfiler
from meshyard.run_dir import RunDir
from tests.conftest import tiny_config
from tests.inprocess import fit_here
from tests.train.test_guard import DATA, GUARD, RUN


def test_a_window_of_steps_is_profiled_into_a_table_and_a_trace(tmp_path):
    cfg = tiny_config(tmp_path, "--train.steps=5", "--metrics.profile_steps=[2, 3]")
    records = fit_here(cfg)
    assert [r.get("profiled", False) for r in records] == [False, True, True, False, False]
    folder = RunDir(cfg.run.run_dir).profile
    table = (folder / "rank-0.txt").read_text()
    assert table.startswith("rank 0, steps 2-3, on cpu:")
    assert "aten::addmm" in table or "aten::mm" in table  # the model's matmuls, by name
    events = json.loads((folder / "rank-0.trace.json").read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_a_run_that_ends_inside_the_window_writes_what_was_profiled(tmp_path):
    profiler = StepProfiler(2, 9, tmp_path, rank=1, device=torch.device("cpu"), report=lambda _: None)
    profiler.step_issued(1)
    assert not profiler.covers(1)
    profiler.step_issued(2)
    torch.ones(4) @ torch.ones(4)
    assert profiler.covers(2) and not profiler.ends_at(2)
    profiler.step_recorded(2)
    profiler.close()
    assert (tmp_path / "rank-1.txt").read_text().startswith("rank 1, step 2 (the run ended before step 9)")
    assert not profiler.covers(3)
    profiler.step_issued(2)  # a step trained again after a rollback: profiled once only
    assert not profiler.covers(2)


def test_the_window_s_ends_hold_back_the_steps_beside_them(tmp_path):
    profiler = StepProfiler(3, 4, tmp_path, rank=0, device=torch.device("cpu"), report=lambda _: None)
    assert profiler.starts_after(2) and not profiler.starts_after(1)
    assert not profiler.ends_at(4)  # not yet profiling
    profiler.step_issued(3)
    try:
        assert profiler.ends_at(4) and not profiler.ends_at(3) and not profiler.starts_after(2)
    finally:
        profiler.close()
    assert not profiler.starts_after(2) and not profiler.ends_at(4)  # once per run


@pytest.mark.parametrize("window, problem", [
    ("[3]", "is not [first, last]"),
    ("[2.0, 3.0]", "is not [first, last]"),
    ("[true, 3]", "is not [first, last]"),
    ("'2-3'", "is not [first, last]"),
    ("[4, 2]", "needs 1 <= first <= last"),
    ("[0, 2]", "needs 1 <= first <= last"),
    ("[7, 9]", "after the run's last (train.steps = 4)"),
])
def test_a_bad_window_is_named(tmp_path, window, problem):
    problems = field_problems(tiny_config(tmp_path, f"--metrics.profile_steps={window}"))
    assert any(problem in p for p in problems), problems


def test_the_doctor_leaves_profiled_steps_out_of_the_steady_ones():
    records = [{"step": i, **({"profiled": True} if i in (12, 13) else {})} for i in range(1, 21)]
    assert [r["step"] for r in steady_records(records)] == [3, *range(4, 12), *range(14, 21)]


def test_writing_the_profile_is_no_step_s_time_and_its_failure_no_run_s(tmp_path, monkeypatch):
    def slow_and_failing(self, prof, steps):
        time.sleep(0.5)
        raise OSError("disk full")

    monkeypatch.setattr(StepProfiler, "_write", slow_and_failing)
    records = fit_here(tiny_config(tmp_path, "--train.steps=5", "--metrics.profile_steps=[2, 3]"))
    assert len(records) == 5 and records[3]["step_time_s"] < 0.5


def test_a_rollback_inside_the_window_ends_the_profile(tmp_path, one_torch_thread):
    # The guard rolls back from step 26 to step 20 (tests/train/test_guard.py).
    cfg = tiny_config(tmp_path, f"--data.source={DATA}:poisoned", *RUN, *GUARD, "--metrics.profile_steps=[25, 30]")
    records = fit_here(cfg)
    assert [(r["step"], r.get("replay", False)) for r in records if r.get("profiled")] == [(25, False), (26, False)]
    table = (RunDir(cfg.run.run_dir).profile / "rank-0.txt").read_text()
    assert table.startswith("rank 0, steps 25-26 (then rolled back before step 30)")


def test_a_run_resumed_past_the_window_s_start_says_it_profiles_nothing(tmp_path):
    said = []
    profiler = StepProfiler(3, 5, tmp_path, rank=0, device=torch.device("cpu"), report=said.append)
    profiler.resumed_at(4)
    profiler.step_issued(5)
    assert not profiler.covers(5) and not (tmp_path / "rank-0.txt").exists()
    assert said == ["metrics.profile_steps = [3, 5]: the run resumed after step 4, past the window's first step, so "
                    "nothing is profiled; give a later window to profile this run"]
    before = StepProfiler(3, 5, tmp_path, rank=0, device=torch.device("cpu"), report=said.append)
    before.resumed_at(2)  # resumed before the window: it is profiled
    before.step_issued(3)
    assert before.covers(3)
    before.close()
