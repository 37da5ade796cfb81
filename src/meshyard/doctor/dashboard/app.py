"""The dashboard's HTTP server: the page, and the records it polls for.

``GET /`` is the page with everything recorded so far; ``GET /api/records?offset=N`` is
what came after offset N (``run_source.Payload``); ``GET /healthz`` answers once the
server is up. Sources read files or ask Prometheus, both blocking: the endpoints are
plain functions, which Starlette runs in its thread pool.
"""

from __future__ import annotations

import math
import socket

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Route

from meshyard.doctor.dashboard.page import API_PATH, render_page
from meshyard.doctor.dashboard.run_source import Source
from meshyard.errors import BadInput

def build_app(source: Source, poll_ms: int) -> Starlette:
    """The dashboard of ``source``, its page polling every ``poll_ms``."""

    def page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_page(source.since(0), poll_ms))

    def records(request: Request) -> JSONResponse:
        try:
            offset = float(request.query_params.get("offset", "0"))
        except ValueError:
            offset = math.nan
        if not math.isfinite(offset) or offset < 0:
            return JSONResponse({"error": "offset is a number >= 0, the one the last answer gave"}, status_code=400)
        try:
            return JSONResponse(source.since(offset))
        except (BadInput, OSError, ValueError) as exc:  # Prometheus away, a record not yet readable
            return JSONResponse({"error": str(exc)}, status_code=502)

    def healthz(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/", page), Route("/" + API_PATH, records), Route("/healthz", healthz)])


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), bound before the server starts so that the
    address it reports is the one taken (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port, or 0 for any "
                       "free one") from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
