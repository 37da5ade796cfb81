"""Reading the figures back from Prometheus: queries, answers, records by step, events."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshyard.cli import main
from meshyard.doctor.dashboard.prometheus_source import (MAX_POINTS, PrometheusError, PrometheusSource,
                                                         events_from, parse_duration, parse_matrix,
                                                         query_range_url, records_from, resolution)
from meshyard.errors import BadInput

NOW = 1_700_000_100.0


def matrix(values: list[tuple[float, float]]) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"job": "train"}, "values": [[t, str(v)] for t, v in values]}]}}


# A run seen every 10 s: steps 1, 1, 2, 3 (the first step scraped twice), then a restart.
SERIES = {
    "meshyard_step": [(NOW - 40, 1), (NOW - 30, 1), (NOW - 20, 2), (NOW - 10, 3)],
    "meshyard_loss": [(NOW - 40, 4.0), (NOW - 30, 4.0), (NOW - 20, 3.0), (NOW - 10, float("nan"))],
    "meshyard_step_time_s": [(t, 0.1) for t in (NOW - 40, NOW - 30, NOW - 20, NOW - 10)],
    **{f"meshyard_{phase}_s": [(t, 0.02) for t in (NOW - 40, NOW - 30, NOW - 20, NOW - 10)]
       for phase in ("data", "forward", "backward", "comm", "optimizer")},
    "meshyard_guard_events_total": [(NOW - 40, 0), (NOW - 30, 0), (NOW - 20, 1), (NOW - 10, 1)],
    "meshyard_start_time_seconds": [(NOW - 40, 100), (NOW - 30, 100), (NOW - 20, 100), (NOW - 10, 190)],
}


def answer(url: str) -> dict:
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    name = query["query"][0].split("{")[0]
    return matrix(SERIES.get(name, []))


def test_query_urls_and_a_bounded_number_of_points():
    url = query_range_url("http://prom:9090/", 'meshyard_loss{job="a"}', 10.0, 70.0, 15)
    assert url.startswith("http://prom:9090/api/v1/query_range?")
    assert urllib.parse.parse_qs(url.split("?")[1]) == {
        "query": ['meshyard_loss{job="a"}'], "start": ["10.000"], "end": ["70.000"], "step": ["15"]}
    assert resolution(0, 60) == 1 and resolution(0, 86400) * MAX_POINTS >= 86400
    assert parse_duration("30m") == 1800 and parse_duration("2d") == 172800
    with pytest.raises(BadInput, match="e.g. 30m, 6h or 2d"):
        parse_duration("6 hours")


def test_an_error_answer_names_the_query():
    with pytest.raises(PrometheusError, match="meshyard_loss.*parse error"):
        parse_matrix({"status": "error", "error": "parse error"}, "meshyard_loss")
    assert parse_matrix({"status": "success", "data": {"result": []}}, "x") == []


def test_instants_become_one_record_per_step_with_the_remainder_of_the_breakdown():
    series = {"step": SERIES["meshyard_step"], "loss": SERIES["meshyard_loss"],
              "step_time_s": SERIES["meshyard_step_time_s"],
              **{f"{p}_s": SERIES[f"meshyard_{p}_s"] for p in ("data", "forward", "backward", "comm", "optimizer")}}
    records = records_from(series)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["time"] == NOW - 40 and records[1]["loss"] == 3.0 and "loss" not in records[2]  # NaN left out
    assert records[0]["other_s"] == pytest.approx(0.0, abs=1e-9)


def test_guard_events_and_restarts_from_the_counter_and_the_start_time():
    events = events_from(SERIES["meshyard_step"], SERIES["meshyard_guard_events_total"],
                         SERIES["meshyard_start_time_seconds"])
    assert [(e["kind"], e["step"]) for e in events] == [("guard", 2), ("restart", 3)]


def test_the_source_asks_every_gauge_over_the_range_then_from_its_offset():
    asked: list[str] = []
    source = PrometheusSource("http://prom:9090", '{job="train"}', 3600, fetch=lambda url: asked.append(url)
                              or answer(url), clock=lambda: NOW)
    payload = source.since(0)
    assert [r["step"] for r in payload["records"]] == [1, 2, 3] and payload["offset"] == NOW - 10
    assert len(payload["events"]) == 2
    queries = [urllib.parse.parse_qs(url.split("?")[1]) for url in asked]
    assert {q["start"][0] for q in queries} == {f"{NOW - 3600:.3f}"}
    assert all(q["query"][0].endswith('{job="train"}') for q in queries)
    assert {"meshyard_mfu", "meshyard_gpu_utilization_pct", "meshyard_cost_so_far_usd"} <= {
        q["query"][0].split("{")[0] for q in queries}
    asked.clear()
    source.since(payload["offset"])
    assert {urllib.parse.parse_qs(url.split("?")[1])["start"][0] for url in asked} == {f"{NOW - 10:.3f}"}


class FakePrometheus(BaseHTTPRequestHandler):
    """Answers query_range from SERIES (timestamps shifted to the server's clock)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps(answer(self.path)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_snapshot_from_a_prometheus_server(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "snapshot.html"
        url = f"http://127.0.0.1:{server.server_port}"
        assert main(["dashboard", "--prometheus", url, "--range", "100000d", "--write", str(out)]) == 0
    finally:
        server.shutdown()
        server.server_close()
    page = out.read_text()
    assert '"step": 3' in page and "restart: rank 0 started again at step 3" in page


def test_an_unreachable_prometheus_is_bad_input(capsys):
    assert main(["dashboard", "--prometheus", "http://127.0.0.1:9", "--write", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshyard dashboard: cannot read http://127.0.0.1:9/api/v1/query_range") and "Traceback" not in err
