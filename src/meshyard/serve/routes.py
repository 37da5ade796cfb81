"""The ASGI application of a ``Server``: every route, meshyard's own (``meshyard.serve.app``)
and the OpenAI-compatible ones (``meshyard.serve.openai_api``), and the error shape of each
(also for refusals made outside a route: no such route, too many connections)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshyard.serve.app import Server, Work, answer, error_response, generate, logits, metrics, models, readyz
from meshyard.serve.openai_api import chat_completions, completions, openai_error
from meshyard.serve.types import ServeError, Unavailable

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
"""Routes whose errors are OpenAI's error objects."""


def errors_of(path: str) -> Callable[[ServeError], Response]:
    """How errors on ``path`` are answered: OpenAI's error object on its routes, meshyard's
    ``{"error": paragraph}`` elsewhere."""
    return openai_error if path in OPENAI_ROUTES else error_response


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) as JSON errors."""
    status = getattr(exc, "status_code", 500)
    text = {404: f"there is no route {request.url.path}; the server answers POST /v1/models/NAME/generate, "
            "POST /v1/models/NAME/logits, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, "
            "/healthz, /readyz and /metrics",
            405: f"{request.method} is not accepted on {request.url.path}; see GET /v1/models for the models "
            "and POST /v1/models/NAME/generate or /logits to ask one"}.get(status, str(getattr(exc, "detail", exc)))
    return errors_of(request.url.path)(ServeError(text, status=status))


def connection_refusal(max_connections: int) -> Callable[[dict[str, Any], Any, Any], Awaitable[None]]:
    """The ASGI application that answers the first request of a connection opened beyond
    ``serve.max_connections`` (``meshyard.serve.connections``): 503 with Retry-After, and the
    connection closed; the body is never read."""
    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        exc = Unavailable(f"the server already holds its most open connections ({max_connections}, "
                          "serve.max_connections), so it closed this one; retry in a moment, reuse a kept-alive "
                          "connection, or spread the load over more replicas")
        response = errors_of(scope.get("path", ""))(exc)
        response.headers.update({"Retry-After": "1", "Connection": "close"})
        await response(scope, receive, send)
    return refuse


def build_app(server: Server) -> Starlette:
    """The ASGI application of ``server``; its lifespan loads the pinned models in the
    background (``/readyz`` answers 503 until they are in) and closes the server's parts."""

    def model_route(endpoint: str, work: Work, errors: Callable[[ServeError], Response] | None = None
                    ) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await answer(server, request, endpoint, work, errors)
        return route

    def plain(handler: Callable[[Server, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await handler(server, request)
        return route

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(server.start())
        try:
            yield
        finally:
            loading.cancel()
            await server.close()

    routes = [Route("/v1/models/{name}/generate", model_route("generate", generate), methods=["POST"]),
              Route("/v1/models/{name}/logits", model_route("logits", logits), methods=["POST"]),
              Route("/v1/models", plain(models), methods=["GET"]),
              Route("/v1/completions", model_route("completions", completions, errors_of("/v1/completions")),
                    methods=["POST"]),
              Route("/v1/chat/completions", model_route("chat", chat_completions, errors_of("/v1/chat/completions")),
                    methods=["POST"]),
              Route("/healthz", healthz, methods=["GET"]),
              Route("/readyz", plain(readyz), methods=["GET"]),
              Route("/metrics", plain(metrics), methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
