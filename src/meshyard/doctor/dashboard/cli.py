"""``meshyard dashboard``: parse the command line, pick the source, then serve or write.

One of three things: serve a live page of a run directory or of Prometheus (default),
write a snapshot of it (``--write``), or print the Grafana dashboard (``--grafana``).
Every bad input is told before anything is served, in one paragraph, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from meshyard.errors import BadInput
from meshyard.extras import require

if TYPE_CHECKING:
    from meshyard.doctor.dashboard.run_source import Source

DEFAULT_PORT = 8050
DEFAULT_POLL_MS = 2000
MIN_POLL_MS = 50  # below this a page polls faster than a step is ever written

DESCRIPTION = """\
Show a run while it trains: loss, throughput, MFU, the step-time breakdown, memory, GPU
utilisation, cost, restarts and guard events, redrawn as records arrive. The figures come
from RUN_DIR (its records, read as they are appended) or from the Prometheus server that
scrapes the run's exporter (metrics.prometheus = true), with --prometheus URL."""

EPILOG = """\
examples:
  meshyard dashboard runs/default-20260101-120000            # http://127.0.0.1:8050/
  meshyard dashboard runs/tiny --port 0 --poll-ms 500
  meshyard dashboard --prometheus http://127.0.0.1:9090 --match '{job="train"}' --range 2h
  meshyard dashboard runs/tiny --write tiny.html              # a snapshot, no server
  meshyard dashboard --grafana > meshyard-grafana.json        # import in Grafana"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard dashboard``; its bad input is told as ``meshyard dashboard: ...``."""
    p = subparsers.add_parser("dashboard", help="a live page of a run's figures (or a Grafana dashboard)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR", help="run directory to show")
    source = p.add_argument_group("Prometheus instead of a run directory")
    source.add_argument("--prometheus", metavar="URL", help="Prometheus server to query, e.g. http://127.0.0.1:9090")
    source.add_argument("--match", default="", metavar="SELECTOR",
                        help="label matchers added to every query, e.g. '{job=\"train\"}' (also for --grafana)")
    source.add_argument("--range", default="6h", metavar="DURATION",
                        help="how far back the page starts, e.g. 30m, 6h, 2d (default 6h)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 opens it)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--poll-ms", type=int, default=DEFAULT_POLL_MS,
                   help=f"how often the page asks for new records (default {DEFAULT_POLL_MS})")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--write", type=Path, metavar="FILE.html", help="write a snapshot page to FILE and exit")
    out.add_argument("--grafana", action="store_true",
                     help="print a Grafana dashboard (JSON) for the run's Prometheus gauges and exit")
    p.set_defaults(handler=dashboard_main, takes_overrides=False, own_errors=(BadInput, OSError, ValueError),
                   error_prefix="meshyard dashboard")


def source_of(args: argparse.Namespace) -> Source:
    """The run directory or Prometheus source the command line names (exactly one)."""
    from meshyard.doctor.dashboard.prometheus_source import PrometheusSource, parse_duration
    from meshyard.doctor.dashboard.run_source import RunDirSource

    if args.run_dir is not None and args.prometheus:
        raise BadInput(f"both RUN_DIR ({args.run_dir}) and --prometheus were given; a dashboard shows one of "
                       "them: drop RUN_DIR to read Prometheus, or --prometheus to read the run directory")
    if args.prometheus:
        return PrometheusSource(args.prometheus, args.match, parse_duration(args.range))
    if args.run_dir is None:
        raise BadInput("no run to show; give RUN_DIR (the folder a run writes, e.g. runs/default-...) or "
                       "--prometheus URL (the Prometheus server that scrapes a run's metrics.prometheus endpoint)")
    if not args.run_dir.is_dir():
        raise BadInput(f"RUN_DIR {str(args.run_dir)!r} is not a directory; give the folder a run writes (its "
                       "run.run_dir, or runs/NAME-... by default)")
    return RunDirSource(args.run_dir)


def dashboard_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Serve the dashboard, write its snapshot, or print the Grafana dashboard."""
    if args.grafana:
        return print_grafana(args)
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port {args.port} is not a port; give one of 1-65535, or 0 for any free one")
    if args.poll_ms < MIN_POLL_MS:
        raise BadInput(f"--poll-ms {args.poll_ms} is too short; give at least {MIN_POLL_MS} (milliseconds between "
                       "the page's requests)")
    source = source_of(args)
    first = source.since(0)  # a run that cannot be read is refused now, not in the page
    if args.write:
        from meshyard.doctor.dashboard.page import render_page

        args.write.write_text(render_page(first, 0, taken=time.strftime("%Y-%m-%d %H:%M:%S")))
        print(f"meshyard: dashboard snapshot written to {args.write}")
        return 0
    return serve(source, args)


def print_grafana(args: argparse.Namespace) -> int:
    from meshyard.doctor.dashboard.grafana import grafana_dashboard
    from meshyard.doctor.dashboard.prometheus_source import check_selector

    if args.run_dir is not None:
        raise BadInput(f"--grafana prints a dashboard of Prometheus gauges and reads no run directory; drop "
                       f"{args.run_dir} (give --match to narrow its queries to one run's job)")
    print(json.dumps(grafana_dashboard(check_selector(args.match)), indent=2))
    return 0


def serve(source: Source, args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C (or SIGTERM)."""
    require("starlette", "meshyard dashboard")
    uvicorn = require("uvicorn", "meshyard dashboard")
    from meshyard.doctor.dashboard.app import bind, build_app, url_of

    sock = bind(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(build_app(source, args.poll_ms), log_level="warning", access_log=False))
    print(f"meshyard: dashboard of {source.title} at {url_of(sock)} (Ctrl-C stops it)", flush=True)
    server.run(sockets=[sock])
    return 0
