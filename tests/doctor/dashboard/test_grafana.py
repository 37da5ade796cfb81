"""The Grafana dashboard queries only gauges the exporter serves, and shows every figure."""

from __future__ import annotations

import json
import re

from meshyard.cli import main
from meshyard.doctor.dashboard.grafana import grafana_dashboard
from meshyard.doctor.figures import FIGURES
from meshyard.metrics.exporters import METRIC_NAMES

METRIC = re.compile(r"\bmeshyard_[a-z0-9_]+")


def exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_query_names_a_metric_the_exporter_serves(capsys):
    assert main(["dashboard", "--grafana", "--match", '{job="train"}']) == 0
    dashboard = json.loads(capsys.readouterr().out)
    named = {name for expr in exprs(dashboard) for name in METRIC.findall(expr)}
    assert named and named <= set(METRIC_NAMES), named - set(METRIC_NAMES)
    assert all(expr.count("meshyard_") == expr.count('{job="train"}') for expr in exprs(dashboard))


def test_each_figure_is_a_panel_with_its_series_and_the_events_are_counted():
    dashboard = grafana_dashboard()
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert all(any(title.startswith(figure.title) for title in titles) for figure in FIGURES)
    breakdown = next(p for p in dashboard["panels"] if p["title"].startswith("Step time breakdown"))
    assert [t["legendFormat"] for t in breakdown["targets"]] == ["data", "forward", "backward", "comm", "optimizer",
                                                                 "other"]
    assert breakdown["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "changes(meshyard_start_time_seconds[$__range])" in exprs(dashboard)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_grafana_reads_no_run_directory(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path), "--grafana"]) == 2
    assert "--grafana prints a dashboard of Prometheus gauges" in capsys.readouterr().err
