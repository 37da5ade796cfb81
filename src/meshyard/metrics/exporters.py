"""Optional sinks on rank 0: a Prometheus endpoint, TensorBoard event files and a Weights &
Biases run.

All receive the same step records as metrics.jsonl. Per-rank figures (gathered every
``metrics.gather_every`` steps) carry a ``rank`` label in Prometheus and a ``rank<N>/``
prefix in TensorBoard and W&B. The Prometheus names are spelled here alone (``metric_name``,
``METRIC_NAMES``): the dashboard queries them and its Grafana panels are built from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshyard.config.load import read_toml
from meshyard.extras import require
from meshyard.metrics.schema import EXPORTED_KEYS, RANK_FIELDS
from meshyard.run_dir import RunDir

# The step figures each exporter sends as scalars: the schema's exported fields.
SCALARS = EXPORTED_KEYS

PREFIX = "meshyard_"
STEP_METRIC = PREFIX + "step"
# A counter of the steps the spike and NaN guard did not keep (records with ``guard``);
# Prometheus' client adds the ``_total`` a counter's samples carry.
GUARD_EVENTS = PREFIX + "guard_events"
GUARD_EVENTS_METRIC = GUARD_EVENTS + "_total"
# When this exporter started: rank 0's process starts again after every restart, so the
# value changes once per restart (``changes()`` counts them).
START_TIME_METRIC = PREFIX + "start_time_seconds"


def metric_name(figure: str) -> str:
    """The Prometheus gauge of a step figure: ``loss`` -> ``meshyard_loss``."""
    return PREFIX + figure


def rank_metric_name(field: str) -> str:
    """The per-rank gauge (label ``rank``) of one of ``RANK_FIELDS``."""
    return f"{PREFIX}rank_{field}"


# Every metric name the endpoint may serve.
METRIC_NAMES: tuple[str, ...] = (STEP_METRIC, *(metric_name(key) for key in SCALARS), GUARD_EVENTS_METRIC,
                                 START_TIME_METRIC, *(rank_metric_name(field) for field in RANK_FIELDS))


class PrometheusExporter:
    """Serves ``meshyard_<figure>`` gauges on http://HOST:PORT/metrics (loopback by default)."""

    def __init__(self, run_dir: Path, host: str, port: int) -> None:
        client = require("prometheus_client", "metrics.prometheus = true")
        CollectorRegistry, Gauge = client.CollectorRegistry, client.Gauge

        self.registry = CollectorRegistry()
        self._gauges = {name: Gauge(metric_name(name), f"meshyard step figure {name}", registry=self.registry)
                        for name in SCALARS}
        self._gauges["step"] = Gauge(STEP_METRIC, "last completed optimizer step", registry=self.registry)
        self._guard_events = client.Counter(GUARD_EVENTS, "steps the spike and NaN guard did not keep",
                                            registry=self.registry)
        Gauge(START_TIME_METRIC, "when rank 0's exporter started (changes at every restart)",
              registry=self.registry).set_to_current_time()
        self._rank_gauges: dict[str, Any] = {}
        self._gauge_cls = Gauge
        self.server, self._thread = client.start_http_server(port, addr=host, registry=self.registry)
        self.url = f"http://{host}:{self.server.server_port}/metrics"
        # Where a scraper (or a test) finds the endpoint when the port was chosen by the OS.
        RunDir(run_dir).prometheus.write_text(json.dumps({"url": self.url}))

    def write(self, record: dict[str, Any]) -> None:
        self._gauges["step"].set(record["step"])
        for name in SCALARS:
            if isinstance(record.get(name), (int, float)):
                self._gauges[name].set(record[name])
        if record.get("guard"):
            self._guard_events.inc()
        for field, values in record.get("ranks", {}).items():
            gauge = self._rank_gauges.get(field)
            if gauge is None:
                gauge = self._rank_gauges[field] = self._gauge_cls(
                    rank_metric_name(field), f"per-rank mean of {field} over the last window", ["rank"],
                    registry=self.registry)
            for rank, value in enumerate(values):
                gauge.labels(rank=str(rank)).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TensorBoardExporter:
    """Writes scalars to ``<run dir>/tensorboard`` (view with ``tensorboard --logdir``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for name in SCALARS:
            if isinstance(record.get(name), (int, float)):
                self.writer.add_scalar(name, record[name], step)
        for field, values in record.get("ranks", {}).items():
            for rank, value in enumerate(values):
                self.writer.add_scalar(f"rank{rank}/{field}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbExporter:
    """Logs scalars to a Weights & Biases run whose files lie under ``<run dir>/wandb``.

    The W&B run starts at the first record rather than here: its config is the run's
    recorded config.toml and run.json, which rank 0 writes after the exporters are built
    and before the first step. ``mode`` 'offline' needs no network (``wandb sync`` uploads
    the folder later). Each attempt of a restarted run is its own W&B run, grouped by the
    run's id."""

    def __init__(self, run_dir: Path, project: str, mode: str) -> None:
        self._wandb = require("wandb", "metrics.wandb = true")
        self.paths = RunDir(run_dir)
        self.project = project
        self.mode = mode
        self.run: Any = None

    def _start(self) -> Any:
        facts = self.paths.read_run_facts()
        config = {"config": read_toml(self.paths.config) if self.paths.config.exists() else {}, "run": facts}
        settings = self._wandb.Settings(silent=True, console="off", disable_git=True, save_code=False)
        # wandb puts its files in a folder of its own naming (RunDir.WANDB) under ``dir``.
        return self._wandb.init(project=self.project, mode=self.mode, dir=str(self.paths.path),
                                name=self.paths.path.name, group=facts.get("run_id"), config=config,
                                settings=settings)

    def write(self, record: dict[str, Any]) -> None:
        if self.run is None:
            self.run = self._start()
        scalars = {name: record[name] for name in SCALARS if isinstance(record.get(name), (int, float))}
        for field, values in record.get("ranks", {}).items():
            scalars.update({f"rank{rank}/{field}": value for rank, value in enumerate(values)})
        self.run.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
