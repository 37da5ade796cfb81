"""The dashboard's figures from Prometheus: the gauges a run exports, read back with query_range.

Prometheus keeps values by time, the page draws them by step: every gauge is queried at
the same instants (``query_range`` evaluates each query at start, start + step, ...), so
the values of one instant, with ``meshyard_step``'s, make one record. The offset is the
last instant read; the next poll asks from there. Restarts and guard events come from
the exporter's start-time gauge (it changes at every restart) and guard counter.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

from meshyard.doctor.dashboard.run_source import Payload
from meshyard.doctor.figures import FIGURE_KEYS, with_other
from meshyard.errors import BadInput
from meshyard.metrics.exporters import (GUARD_EVENTS_METRIC, SCALARS, START_TIME_METRIC, STEP_METRIC,
                                        metric_name)

MAX_POINTS = 2000  # per series and query: Prometheus refuses more than 11,000
TIMEOUT_S = 10.0
_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# The record keys Prometheus has a gauge for, in the order the figures read them.
QUERIED_KEYS: tuple[str, ...] = tuple(key for key in FIGURE_KEYS if key in SCALARS)

Series = list[tuple[float, float]]
Fetch = Callable[[str], dict[str, Any]]


class PrometheusError(BadInput):
    """Prometheus could not be asked, or refused the query; the message says which and why."""


def parse_duration(text: str) -> int:
    """Seconds of ``30m``, ``6h``, ``2d`` (``--range``)."""
    found = _DURATION.match(text.strip())
    if not found or int(found.group(1)) == 0:
        raise BadInput(f"--range {text!r} is not a duration; give a whole number and a unit, e.g. 30m, 6h or 2d")
    return int(found.group(1)) * _SECONDS[found.group(2)]


def check_selector(selector: str) -> str:
    """``--match``: label matchers in braces, added to every query (``{job="train"}``)."""
    if selector and not (selector.startswith("{") and selector.endswith("}")):
        raise BadInput(f"--match {selector!r} is not a label selector; give label matchers in braces, "
                       "e.g. --match '{job=\"train\"}'")
    return selector


def resolution(start: float, end: float) -> int:
    """Seconds between the instants of one query: at most ``MAX_POINTS`` per series."""
    return max(1, math.ceil((end - start) / MAX_POINTS))


def query_range_url(base: str, expr: str, start: float, end: float, step: int) -> str:
    """The URL of Prometheus' range query of ``expr`` over [start, end]."""
    query = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})
    return f"{base.rstrip('/')}/api/v1/query_range?{query}"


def parse_matrix(body: dict[str, Any], expr: str) -> Series:
    """The (time, value) points of a query_range answer's first series; empty when none
    matched. Values Prometheus writes as strings ('NaN' included) become floats."""
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus refused the query {expr!r}: {body.get('error', body)}")
    result = body.get("data", {}).get("result", [])
    return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []


def records_from(series: dict[str, Series]) -> list[dict[str, Any]]:
    """One record per step: the figures' values at the first instant that step was current."""
    steps = dict(series.get("step", []))
    by_time: dict[float, dict[str, Any]] = {t: {"step": int(step), "time": t} for t, step in steps.items()}
    for key, points in series.items():
        for t, value in points:
            if key != "step" and t in by_time and not math.isnan(value):
                by_time[t][key] = value
    records: dict[int, dict[str, Any]] = {}
    for t in sorted(by_time):
        records.setdefault(by_time[t]["step"], with_other(by_time[t]))
    return list(records.values())


def events_from(steps: Series, guard: Series, start_times: Series) -> list[dict[str, Any]]:
    """Guard events where the guard counter grew, restarts where the exporter's start time
    changed, each at the step current then."""
    step_at = dict(steps)
    events = []
    for (_, before), (t, after) in zip(start_times, start_times[1:]):
        if after != before:
            step = int(step_at.get(t, 0))
            events.append({"step": step, "kind": "restart", "text": f"restart: rank 0 started again at step {step}"})
    for (_, before), (t, after) in zip(guard, guard[1:]):
        if after > before:  # a restart sets the counter back to 0: not an event
            step = int(step_at.get(t, 0))
            events.append({"step": step, "kind": "guard", "text": f"step {step}: {after - before:g} not kept"})
    return sorted(events, key=lambda event: event["step"])


def fetch_json(url: str) -> dict[str, Any]:
    """GET ``url`` and read its JSON (Prometheus answers a bad query with 400 and a JSON error)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            raise PrometheusError(f"Prometheus answered HTTP {exc.code} to {url}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"cannot read {url}: {getattr(exc, 'reason', exc)}; check --prometheus (the "
                              "server's address, e.g. http://127.0.0.1:9090)") from None


class PrometheusSource:
    """Follows a run through the Prometheus server that scrapes its exporter."""

    def __init__(self, url: str, selector: str = "", range_s: int = 6 * 3600, fetch: Fetch = fetch_json,
                 clock: Callable[[], float] = time.time) -> None:
        if not url.startswith(("http://", "https://")):
            raise BadInput(f"--prometheus {url!r} is not an HTTP address; give the Prometheus server's, "
                           "e.g. --prometheus http://127.0.0.1:9090")
        self.url, self.selector, self.range_s = url, check_selector(selector), range_s
        self.fetch, self.clock = fetch, clock
        self.title = f"{url} {selector}".strip()

    def query(self, metric: str, start: float, end: float) -> Series:
        expr = metric + self.selector
        return parse_matrix(self.fetch(query_range_url(self.url, expr, start, end, resolution(start, end))), expr)

    def since(self, offset: float) -> Payload:
        end = self.clock()
        start = offset if offset > 0 else end - self.range_s
        series = {"step": self.query(STEP_METRIC, start, end)}
        series.update((key, self.query(metric_name(key), start, end)) for key in QUERIED_KEYS)
        events = events_from(series["step"], self.query(GUARD_EVENTS_METRIC, start, end),
                             self.query(START_TIME_METRIC, start, end))
        last = series["step"][-1][0] if series["step"] else offset
        return Payload(title=self.title, offset=last, reset=False, records=records_from(series), events=events,
                       finished=False)
