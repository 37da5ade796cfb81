"""Prometheus endpoint and TensorBoard files, from real runs."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

from meshyard.metrics.exporters import SCALARS
from tests.checkpoint.helpers import finish, start


def test_exported_scalars_are_the_schemas_and_keep_their_order():
    """Prometheus lists gauges in the order they were registered: the same as before the
    list came from the schema."""
    assert SCALARS == ("loss", "eval_loss", "lr", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s",
                       "samples_per_s", "mfu", "data_s", "forward_s", "backward_s", "comm_s", "optimizer_s",
                       "rss_bytes", "gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "comm_bytes",
                       "compression_ratio")


def test_prometheus_serves_step_and_per_rank_metrics_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--train.steps=2000", "--metrics.prometheus=true", "--metrics.prometheus_port=0",
                 "--metrics.gather_every=2", "--checkpoint.enabled=false")
    try:
        deadline = time.monotonic() + 120
        body = ""
        while time.monotonic() < deadline and 'meshyard_rank_busy_s{rank="1"}' not in body:
            time.sleep(0.2)
            if (run_dir / "prometheus.json").exists():
                url = json.loads((run_dir / "prometheus.json").read_text())["url"]
                assert url.startswith("http://127.0.0.1:")
                body = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc)
    for name in ("meshyard_step ", "meshyard_loss ", "meshyard_step_time_s ", "meshyard_tokens_per_s ",
                 "meshyard_forward_s ", "meshyard_comm_s ", "meshyard_mfu ", 'meshyard_rank_busy_s{rank="0"}',
                 'meshyard_rank_busy_s{rank="1"}', 'meshyard_rank_step_time_s{rank="1"}'):
        assert name in body, name


def test_tensorboard_event_files_when_enabled(make_config):
    import meshyard
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
