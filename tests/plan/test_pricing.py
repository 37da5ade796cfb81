"""What ``meshyard plan`` says a layout costs: on demand, and on spot capacity with measured restarts."""

from __future__ import annotations

import json

import pytest

from meshyard.metrics.cost import Price
from meshyard.plan.cli import run
from meshyard.plan.pricing import MeasuredRestarts, Pricing
from meshyard.run_dir import RunDir


def _measured_run(path, step_times, restarts):
    path.mkdir()
    RunDir(path).metrics.write_text("".join(json.dumps({"step": i + 1, "step_time_s": t}) + "\n"
                                            for i, t in enumerate(step_times)))
    for entry in restarts:
        RunDir(path).append_restart(entry)
    return MeasuredRestarts.read(path)


def test_a_layout_costs_its_devices_for_the_time_its_tokens_take():
    cost = Pricing(Price(2.0), tokens=1e9).cost_of(tokens_per_second=1e5, step_time_s=0.5, devices=8)
    assert cost.train_s == pytest.approx(1e4)
    assert cost.cost_usd == pytest.approx(2.0 / 3600 * 8 * 1e4)
    assert cost.spot_usd is None  # no spot price


def test_spot_adds_the_measured_restart_overhead_at_the_rate_the_run_restarted(tmp_path):
    measured = _measured_run(tmp_path / "run", [1.0] * 100, [{"steps_lost": 4, "resume_s": 20.0}])
    pricing = Pricing(Price(2.0, 0.5), tokens=1e9, measured=measured)
    cost = pricing.cost_of(tokens_per_second=1e5, step_time_s=0.5, devices=8)
    # One restart per 100 s of steps; each costs 20 s to resume and 4 steps of 0.5 s.
    overhead = (20.0 + 4 * 0.5) * 1e4 / 100
    assert cost.overhead_s == pytest.approx(overhead)
    assert cost.spot_usd == pytest.approx(0.5 / 3600 * 8 * (1e4 + overhead))


def test_without_restarts_spot_is_its_price_for_the_time(tmp_path):
    measured = _measured_run(tmp_path / "run", [1.0], [])
    cost = Pricing(Price(2.0, 0.5), 1e9, measured).cost_of(1e5, 0.5, 8)
    assert cost.spot_usd == pytest.approx(0.5 / 3600 * 8 * 1e4)


def test_the_table_prices_the_gpu_and_the_plan_lists_cost_columns(capsys):
    assert run(["--model", "gpt2-124m", "--gpus", "8", "--gpu", "a100", "--top", "1", "--explain", "0",
                "--show-rejected", "0"]) == 0
    out = capsys.readouterr().out
    assert "Hours and costs to train 1B tokens, at $1.80 per GPU-hour (price table (a100)); spot at $0.90" in out
    assert "without restarts (--restarts RUN_DIR" in out


@pytest.mark.parametrize("argv, expected", [
    (["--gpu-hour-price", "-1"], "--gpu-hour-price -1.0 must be a price of at least 0"),
    (["--spot-hour-price", "-2"], "--spot-hour-price -2.0 must be a price of at least 0"),
    (["--tokens", "lots"], "--tokens: 'lots' is not a count above zero"),
    (["--restarts", "/nonexistent/run"], "--restarts /nonexistent/run is not a run directory"),
])
def test_bad_prices_are_one_message_and_exit_code_2(argv, expected, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshyard plan: ") and expected in err and "Traceback" not in err
