"""The arithmetic of cost: prices, each step's cost, the projection, restarts and spot capacity."""

from __future__ import annotations

import pytest

from meshyard.metrics.cost import (PRICES, CostMeter, Price, cost_summary, device_time_cost, fmt_usd, projected_cost,
                                   resolve_price, restart_overhead_s)


def test_a_given_price_overrides_the_table_and_the_table_prices_a_known_gpu():
    assert resolve_price(2.5, 0.0, "h100") == Price(2.5, PRICES["h100"].spot, "run.gpu_hour_price")
    assert resolve_price(0.0, 0.0, "h100") == Price(PRICES["h100"].on_demand, PRICES["h100"].spot,
                                                    "price table (h100)")
    assert resolve_price(0.0, 0.7, "h100").spot_per_hour == 0.7


def test_no_price_means_no_cost():
    assert resolve_price(0.0, 0.0, None) is None  # a CPU run without run.gpu_hour_price
    assert resolve_price(0.0, 1.0, "a-gpu-nobody-lists") is None
    assert resolve_price(1.0, 0.0, None) == Price(1.0, 0.0, "run.gpu_hour_price")


def test_a_step_costs_price_per_second_times_devices_times_its_time():
    assert device_time_cost(3.6, 4, 0.5) == pytest.approx(3.6 / 3600 * 4 * 0.5)


def test_the_meter_sums_steps_and_projects_the_rest_at_the_recent_mean():
    meter = CostMeter(Price(3.6), devices=2, total_steps=10, recent_steps=2)
    so_far, seen = 0.0, []
    for step, seconds in enumerate((1.0, 2.0, 4.0), start=1):
        figures = meter.step_figures(step, seconds, so_far)
        cost = 3.6 / 3600 * 2 * seconds
        seen.append(cost)
        assert figures["cost_per_step_usd"] == pytest.approx(cost)
        so_far += cost
        assert figures["cost_so_far_usd"] == pytest.approx(so_far)
        recent = seen[-2:]
        assert figures["cost_projected_usd"] == pytest.approx(so_far + (10 - step) * sum(recent) / len(recent))
    assert projected_cost(5.0, 0, [1.0]) == 5.0  # the last step: nothing left


def test_restart_overhead_is_time_to_resume_plus_lost_steps_done_again():
    restarts = [{"steps_lost": 3, "resume_s": 40.0}, {"steps_lost": 0}, {"steps_lost": 1, "resume_s": 10.0}]
    assert restart_overhead_s(restarts, step_time_s=2.0) == pytest.approx(40 + 3 * 2 + 0 + 10 + 1 * 2)


def test_spot_capacity_pays_its_price_for_the_paid_time_and_the_restart_overhead():
    price = Price(per_hour=4.0, spot_per_hour=1.0, source="run.gpu_hour_price")
    cost_so_far = 4.0 / 3600 * 8 * 900  # 8 devices for 900 s of steps
    summary = cost_summary(price, 8, cost_so_far, step_time_s=1.5, restarts=[{"steps_lost": 20, "resume_s": 120.0}])
    overhead = 120 + 20 * 1.5
    assert summary["device_hours"] == pytest.approx(8 * 900 / 3600)
    assert summary["cost_usd"] == pytest.approx(cost_so_far)
    assert summary["restart_overhead_s"] == pytest.approx(overhead)
    assert summary["restart_cost_usd"] == pytest.approx(4.0 / 3600 * 8 * overhead)
    assert summary["spot_cost_usd"] == pytest.approx(1.0 / 3600 * 8 * (900 + overhead))
    assert "spot_cost_usd" not in cost_summary(Price(4.0), 8, cost_so_far, 1.5)


def test_price_facts_round_trip_through_run_json():
    price = Price(2.0, 0.5, "price table (a100)")
    assert Price.from_facts(price.facts()) == price
    assert Price.from_facts({}) is None


def test_money_reads_without_exponents():
    assert fmt_usd(1234.5) == "$1,234.50"
    assert fmt_usd(0.0123) == "$0.0123"
    assert fmt_usd(0.0000278) == "$0.0000278"
    assert fmt_usd(0.0) == "$0.00"
