"""A priced run: its records, summary.json, progress line, Prometheus, report and plan show cost."""

from __future__ import annotations

import json
import urllib.request

import pytest

import meshyard
from meshyard.metrics.console import ProgressDisplay, cost_text
from meshyard.metrics.cost import Price, fmt_usd
from meshyard.metrics.exporters import PrometheusExporter
from meshyard.metrics.records import read_metrics
from meshyard.run_dir import RunDir

PRICE, SPOT = 3.6, 1.8
STEPS = 4


@pytest.fixture(scope="module")
def priced_run(tmp_path_factory):
    """A 1-rank CPU run of a few steps at run.gpu_hour_price = 3.6, and its console output."""
    tmp = tmp_path_factory.mktemp("priced")
    config = meshyard.load_config(None, [
        "--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--data.random_tokens=20000",
        f"--data.cache_dir={tmp / 'cache'}", "--train.global_batch=4", f"--train.steps={STEPS}",
        "--train.eval_every=0", "--metrics.progress_bar=false", "--metrics.log_every=1", "--metrics.mfu=false",
        "--checkpoint.enabled=false", "--run.nproc=1", f"--run.run_dir={tmp / 'run'}",
        f"--run.gpu_hour_price={PRICE}", f"--run.spot_hour_price={SPOT}",
    ])
    return meshyard.run(config, nproc=1)


def test_records_hold_each_steps_cost_by_hand_arithmetic(priced_run):
    records = read_metrics(priced_run.run_dir)
    assert len(records) == STEPS
    so_far = 0.0
    for record in records:
        per_step = PRICE / 3600 * 1 * record["step_time_s"]
        so_far += per_step
        assert record["cost_per_step_usd"] == pytest.approx(per_step)
        assert record["cost_so_far_usd"] == pytest.approx(so_far)
        seen = [r["cost_per_step_usd"] for r in records if r["step"] <= record["step"]][-10:]
        assert record["cost_projected_usd"] == pytest.approx(
            so_far + (STEPS - record["step"]) * sum(seen) / len(seen))
    assert records[-1]["cost_projected_usd"] == pytest.approx(records[-1]["cost_so_far_usd"])


def test_summary_and_run_json_hold_the_cost(priced_run):
    records = read_metrics(priced_run.run_dir)
    summary = RunDir(priced_run.run_dir).read_summary()
    total = sum(r["cost_per_step_usd"] for r in records)
    assert summary["cost_usd"] == pytest.approx(total)
    assert summary["device_hours"] == pytest.approx(sum(r["step_time_s"] for r in records) / 3600)
    assert summary["gpu_hour_price"] == PRICE and summary["price_source"] == "run.gpu_hour_price"
    assert summary["restart_overhead_s"] == 0.0  # no restart
    assert summary["spot_cost_usd"] == pytest.approx(SPOT / 3600 * sum(r["step_time_s"] for r in records))
    facts = RunDir(priced_run.run_dir).read_run_facts()
    assert Price.from_facts(facts) == Price(PRICE, SPOT, "run.gpu_hour_price")


def test_the_progress_line_shows_cost_so_far_and_projected(priced_run, capsys):
    record = read_metrics(priced_run.run_dir)[0]
    ProgressDisplay(STEPS, log_every=1, use_bar=False).update(record)
    line = capsys.readouterr().out
    assert (f"cost {fmt_usd(record['cost_so_far_usd'])}, projected {fmt_usd(record['cost_projected_usd'])}"
            in line)
    assert cost_text({"step": 1}) == ""  # no price, nothing said


def test_prometheus_serves_the_cost_gauges(priced_run, tmp_path):
    exporter = PrometheusExporter(tmp_path, "127.0.0.1", 0)
    try:
        record = read_metrics(priced_run.run_dir)[-1]
        exporter.write(record)
        body = urllib.request.urlopen(exporter.url, timeout=5).read().decode()
    finally:
        exporter.close()
    values = {line.split()[0]: float(line.split()[1]) for line in body.splitlines() if line.startswith("meshyard_")}
    assert values["meshyard_cost_so_far_usd"] == pytest.approx(record["cost_so_far_usd"])
    assert values["meshyard_cost_projected_usd"] == pytest.approx(record["cost_projected_usd"])
    assert values["meshyard_cost_per_step_usd"] == pytest.approx(record["cost_per_step_usd"])


def test_the_report_shows_cost_and_spot_with_the_restart_overhead(priced_run, tmp_path):
    from meshyard.doctor.report import cost_section, write_report

    run_dir = priced_run.run_dir
    records = read_metrics(run_dir)
    facts = RunDir(run_dir).read_run_facts()
    restarts = [{"restart": 1, "steps_lost": 2, "resume_s": 30.0}]
    section = cost_section(facts, records, restarts)
    step_time = sum(r["step_time_s"] for r in records[1:]) / (len(records) - 1)
    overhead = 30.0 + 2 * step_time
    spot = SPOT / 3600 * (sum(r["step_time_s"] for r in records) + overhead)
    assert "<h2>Cost</h2>" in section and "$3.60 per device-hour (run.gpu_hour_price)" in section
    assert f"{overhead:.1f} s" in section and "1 restart(s)" in section
    assert f"on spot capacity</th><td>{fmt_usd(spot)} at $1.80 per device-hour" in section
    page = write_report(run_dir, tmp_path / "report.html").read_text()
    assert "<h2>Cost</h2>" in page


def test_plan_prices_layouts_with_the_runs_measured_restarts(priced_run, capsys):
    from meshyard.plan.cli import run

    RunDir(priced_run.run_dir).append_restart({"restart": 1, "steps_lost": 2, "resume_s": 30.0})
    try:
        code = run(["--model", "gpt2-124m", "--gpus", "8", "--top", "2", "--explain", "0", "--show-rejected", "0",
                    "--tokens", "10B", "--gpu-hour-price", "2", "--spot-hour-price", "1",
                    "--restarts", str(priced_run.run_dir)])
    finally:
        RunDir(priced_run.run_dir).restarts.unlink()
    out = capsys.readouterr().out
    assert code == 0
    assert "Hours and costs to train 10B tokens, at $2.00 per GPU-hour (--gpu-hour-price)" in out
    assert f"with the restart overhead measured in {priced_run.run_dir}: 1 restart(s)" in out
    assert "30 s to resume and 2 step(s) lost" in out


def test_a_resumed_run_goes_on_from_its_checkpointed_cost_and_pays_its_restart_on_spot(tmp_path):
    def config(steps: int):
        return meshyard.load_config(None, [
            "--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--data.random_tokens=20000",
            f"--data.cache_dir={tmp_path / 'cache'}", "--train.global_batch=4", f"--train.steps={steps}",
            "--train.eval_every=0", "--metrics.progress_bar=false", "--metrics.mfu=false",
            "--checkpoint.interval=2", "--checkpoint.async_save=false", "--run.nproc=1",
            f"--run.run_dir={tmp_path / 'run'}", f"--run.gpu_hour_price={PRICE}", f"--run.spot_hour_price={SPOT}",
        ])

    meshyard.run(config(3), nproc=1)
    result = meshyard.run(config(5), nproc=1)  # resumes the final checkpoint of step 3
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[3]["cost_so_far_usd"] == pytest.approx(records[2]["cost_so_far_usd"]
                                                          + PRICE / 3600 * records[3]["step_time_s"])
    [restart] = RunDir(result.run_dir).read_restarts()
    assert restart["steps_lost"] == 0 and restart["resume_s"] >= 0
    summary = result.summary
    assert summary["cost_usd"] == pytest.approx(sum(r["cost_per_step_usd"] for r in records))
    assert summary["restart_overhead_s"] == pytest.approx(restart["resume_s"])
    assert summary["spot_cost_usd"] == pytest.approx(
        SPOT / 3600 * (sum(r["step_time_s"] for r in records) + restart["resume_s"]))
