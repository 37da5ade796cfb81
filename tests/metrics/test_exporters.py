"""Prometheus endpoint and TensorBoard files, from real runs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import meshyard
from meshyard.fault.preemption import Preempted
from meshyard.metrics.exporters import SCALARS
from meshyard.run_dir import RunDir
from tests.checkpoint.helpers import JOB, worker_pid


def test_exported_scalars_are_the_schemas_and_keep_their_order():
    """Prometheus lists gauges in the order they were registered: the same as before the
    list came from the schema."""
    assert SCALARS == ("loss", "eval_loss", "lr", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s",
                       "samples_per_s", "mfu", "data_s", "forward_s", "backward_s", "comm_s", "optimizer_s",
                       "rss_bytes", "gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "gpu_utilization_pct",
                       "comm_bytes", "compression_ratio",
                       "moe_aux_loss", "moe_z_loss", "moe_dropped_tokens", "moe_imbalance",
                       "cost_per_step_usd", "cost_so_far_usd", "cost_projected_usd")


RANK1_GAUGE = 'meshyard_rank_busy_s{rank="1"}'


def scrape_until_rank1_then_stop(run_dir: Path, scraped: dict, run_over: threading.Event) -> None:
    """Scrape the run's endpoint until rank 1's figures are served (the first per-rank
    gather, at step 2), then stop the run: a SIGTERM to rank 0's worker is a preemption,
    which every rank honours at the next step boundary."""
    deadline = time.monotonic() + 120
    body = ""
    try:
        while time.monotonic() < deadline and not run_over.is_set() and RANK1_GAUGE not in body:
            time.sleep(0.2)
            try:
                url = json.loads((run_dir / "prometheus.json").read_text())["url"]
            except (OSError, ValueError):  # not written yet, or not completely
                continue
            scraped["url"] = url
            body = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        scraped["body"] = body
        if not run_over.is_set():
            os.kill(worker_pid(run_dir, 0), signal.SIGTERM)


def test_prometheus_serves_step_and_per_rank_metrics_on_loopback(tmp_path, monkeypatch):
    """A 2-rank run through ``meshyard.run`` (the launcher and workers of ``meshyard run``,
    without a command's own interpreter start), scraped while it trains."""
    run_dir = tmp_path / "run"
    config = meshyard.load_config(None, [
        *JOB, f"--run.run_dir={run_dir}", f"--data.cache_dir={tmp_path / 'cache'}", "--train.steps=2000",
        "--metrics.prometheus=true", "--metrics.prometheus_port=0", "--metrics.gather_every=2",
        "--checkpoint.enabled=false"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    scraped: dict = {}
    run_over = threading.Event()
    scraper = threading.Thread(target=scrape_until_rank1_then_stop, args=(run_dir, scraped, run_over), daemon=True)
    scraper.start()
    try:
        with pytest.raises(Preempted):
            meshyard.run(config, nproc=2)
    finally:
        run_over.set()
        scraper.join(timeout=30)
    assert scraped["url"].startswith("http://127.0.0.1:")
    body = scraped["body"]
    for name in ("meshyard_step ", "meshyard_loss ", "meshyard_step_time_s ", "meshyard_tokens_per_s ",
                 "meshyard_forward_s ", "meshyard_comm_s ", "meshyard_mfu ", 'meshyard_rank_busy_s{rank="0"}',
                 RANK1_GAUGE, 'meshyard_rank_step_time_s{rank="1"}'):
        assert name in body, name


def test_tensorboard_event_files_when_enabled(make_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config("--metrics.tensorboard=true", "--parallel.strategy=none", "--train.steps=3")
    run_dir = meshyard.run(cfg, nproc=1).run_dir
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "step_time_s", "tokens_per_s", "forward_s"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    off = make_config("--parallel.strategy=none", "--train.steps=1", "--run.run_dir=" + str(run_dir.parent / "off"))
    assert not (meshyard.run(off, nproc=1).run_dir / "tensorboard").exists()


def read_wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (``run-<id>.wandb``): after a 7-byte file
    header, 32 KiB blocks of chunks, each a 7-byte header (checksum, little-endian length,
    kind: 1 whole, 2 first, 3 middle, 4 last) and its part of one protobuf ``Record``."""
    from wandb.proto.wandb_internal_pb2 import Record

    block, data = 32 * 1024, path.read_bytes()
    records, parts, at = [], b"", 7
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
        if kind == 0:  # zero padding
            break
        parts += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def items(entries: Any) -> dict[str, Any]:
    """A W&B record's items by key (a flat key, or the parts of a nested one joined by '/')."""
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}


def test_wandb_offline_run_logs_the_losses_of_metrics_jsonl(make_config):
    import meshyard.metrics.records as records

    cfg = make_config("--metrics.wandb=true", "--metrics.wandb_project=tiny", "--parallel.strategy=none",
                      "--train.steps=3")
    run_dir = meshyard.run(cfg, nproc=1).run_dir
    [log] = (RunDir(run_dir).wandb).glob("offline-run-*/run-*.wandb")
    logged = read_wandb_records(log)
    history = {record.history.step.num: items(record.history.item)
               for record in logged if record.WhichOneof("record_type") == "history"}
    expected = {r["step"]: r["loss"] for r in records.read_metrics(run_dir)}
    assert {step: figures["loss"] for step, figures in history.items()} == expected
    [run] = [record.run for record in logged if record.WhichOneof("record_type") == "run"]
    assert run.project == "tiny"
    config = items(run.config.update)
    assert config["run"]["run_id"] == RunDir(run_dir).read_run_facts()["run_id"]
    assert config["config"]["metrics"]["wandb"] is True


def test_guard_events_are_counted_and_the_start_time_is_served(tmp_path):
    """Without a run: one record the guard did not keep, scraped from a loopback endpoint."""
    from meshyard.metrics.exporters import METRIC_NAMES, PrometheusExporter

    exporter = PrometheusExporter(tmp_path, "127.0.0.1", 0)
    try:
        exporter.write({"step": 3, "loss": 2.5, "guard": "loss spike", "gpu_utilization_pct": 91.0})
        body = urllib.request.urlopen(exporter.url, timeout=5).read().decode()
    finally:
        exporter.close()
    assert "meshyard_guard_events_total 1.0" in body and "meshyard_gpu_utilization_pct 91.0" in body
    served = {line.split(" ")[0].split("{")[0] for line in body.splitlines() if line.startswith("meshyard_")}
    assert "meshyard_start_time_seconds" in served and served <= set(METRIC_NAMES) | {"meshyard_guard_events_created"}
