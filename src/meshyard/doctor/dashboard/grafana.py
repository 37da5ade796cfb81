"""A Grafana dashboard for the Prometheus gauges a run exports (``meshyard dashboard --grafana``).

Its panels are the dashboard page's figures (``doctor.figures``), each series the gauge
``metrics.exporters`` names for its record key, so the two dashboards show the same
things. Series without a gauge are left out; the breakdown's remainder ("other") is
computed from the step time and the phases. Import it in Grafana (Dashboards > Import)
and pick the Prometheus data source that scrapes the run.
"""

from __future__ import annotations

from typing import Any

from meshyard.doctor.figures import FIGURES, BREAKDOWN_KEYS, Figure
from meshyard.metrics.exporters import (GUARD_EVENTS_METRIC, SCALARS, START_TIME_METRIC, STEP_METRIC,
                                        metric_name, rank_metric_name)
from meshyard.metrics.schema import OTHER_KEY

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT = 12, 8  # of a chart, in Grafana's grid (24 columns)
UNITS = {"%": "percent", "USD": "currencyUSD", "ms": "ms", "MiB": "decmbytes", "tokens/s": "short", "nats": "short"}


def _expr(key: str, scale: float, selector: str) -> str | None:
    """The PromQL of one series: its gauge times its scale; None when nothing exports it."""
    if key == OTHER_KEY:
        parts = " + ".join(metric_name(k) + selector for k in BREAKDOWN_KEYS)
        expr = f"clamp_min({metric_name('step_time_s')}{selector} - ({parts}), 0)"
    elif key in SCALARS:
        expr = metric_name(key) + selector
    else:
        return None
    return expr if scale == 1.0 else f"{expr} * {scale:g}"


def chart_panel(figure: Figure, selector: str, index: int) -> dict[str, Any]:
    targets = [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": series.label, "datasource": DATASOURCE}
               for i, series in enumerate(figure.series) if (expr := _expr(series.key, series.scale, selector))]
    custom = {"stacking": {"mode": "normal"}, "fillOpacity": 60} if figure.stacked else {"fillOpacity": 0}
    return {"type": "timeseries", "title": f"{figure.title} ({figure.unit})", "datasource": DATASOURCE,
            "gridPos": {"x": (index % 2) * WIDTH, "y": 4 + (index // 2) * HEIGHT, "w": WIDTH, "h": HEIGHT},
            "fieldConfig": {"defaults": {"unit": UNITS.get(figure.unit, "short"), "custom": custom},
                            "overrides": []},
            "targets": targets}


def stat_panel(title: str, expr: str, x: int) -> dict[str, Any]:
    return {"type": "stat", "title": title, "datasource": DATASOURCE, "gridPos": {"x": x, "y": 0, "w": 6, "h": 4},
            "targets": [{"refId": "A", "expr": expr, "datasource": DATASOURCE}]}


def grafana_dashboard(selector: str = "") -> dict[str, Any]:
    """The dashboard as Grafana's JSON model; ``selector`` (``{job="train"}``) narrows every query."""
    stats = [stat_panel("Step", STEP_METRIC + selector, 0),
             stat_panel("Restarts in range", f"changes({START_TIME_METRIC}{selector}[$__range])", 6),
             stat_panel("Guard events in range", f"increase({GUARD_EVENTS_METRIC}{selector}[$__range])", 12),
             stat_panel("Cost so far (USD)", metric_name("cost_so_far_usd") + selector, 18)]
    charts = [chart_panel(figure, selector, i) for i, figure in enumerate(FIGURES)]
    ranks = {"type": "timeseries", "title": "Per-rank busy time (ms, gathered windows)", "datasource": DATASOURCE,
             "gridPos": {"x": (len(charts) % 2) * WIDTH, "y": 4 + (len(charts) // 2) * HEIGHT, "w": WIDTH,
                         "h": HEIGHT},
             "targets": [{"refId": "A", "expr": f"{rank_metric_name('busy_s')}{selector} * 1000",
                          "legendFormat": "rank {{rank}}", "datasource": DATASOURCE}]}
    panels = [*stats, *charts, ranks]
    for number, panel in enumerate(panels, 1):
        panel["id"] = number
    return {"title": "meshyard training run", "uid": "meshyard-run", "schemaVersion": 39, "version": 1,
            "editable": True, "refresh": "10s", "time": {"from": "now-6h", "to": "now"}, "tags": ["meshyard"],
            "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                     "query": "prometheus"}]},
            "panels": panels}
