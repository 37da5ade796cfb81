"""The HTTP side of ``meshyard serve``: the ``Server`` that wires the parts, and its routes.

A generate or logits request goes, in order: body read and checked
(``meshyard.serve.requests``) -> version chosen (``Router``, or the ``X-Model-Version``
header) -> prediction cache (deterministic requests only) -> the model, loaded on first use
(``ModelCache``; held in use so it is never evicted while the request waits) -> the batcher
of that model version and endpoint, which runs batches in the single inference thread ->
the answer, stored in the prediction cache. Every failure becomes ``{"error": paragraph}``
(OpenAI's error object on the OpenAI-compatible routes of ``meshyard.serve.openai_api``)
with its status; an unexpected one is a 500 whose traceback goes to the server's log, and
the server goes on answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import torch
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from meshyard.config.sections import ServeConfig
from meshyard.inference.chat_template import ChatTemplate
from meshyard.inference.engine import Engine
from meshyard.inference.loading import load_engine
from meshyard.inference.source import ModelSource
from meshyard.models.kv_cache import supports_kv_cache
from meshyard.serve.batching import ClientDisconnected, DisconnectCheck, DynamicBatcher
from meshyard.serve.connections import client_link
from meshyard.serve.continuous import ContinuousBatcher
from meshyard.serve.dynamic_generate import DynamicGenerateItem, run_generate
from meshyard.serve.metrics import ServeMetrics
from meshyard.serve.model_cache import ModelCache
from meshyard.serve.prediction_cache import cache_key, open_cache
from meshyard.serve.requests import parse_generate, parse_logits, read_payload
from meshyard.serve.routing import VERSION_HEADER, Router
from meshyard.serve.types import BadRequest, DeadlineExceeded, QueueFull, ReadTimeout, ServeError

log = logging.getLogger("meshyard.serve")

# With serve.scheduler = "auto", a continuous batcher's KV cache may take this share of its
# CUDA device's memory at most; a larger one (long contexts) leaves the model to dynamic batches.
AUTO_KV_SHARE = 0.25

GENERATE_EXAMPLE = '{"prompt": "Hello", "max_new_tokens": 16}'
LOGITS_EXAMPLE = '{"sequences": [[72, 101, 108]], "top_k": 5}'
LOWEST_LOGPROB = -1e30  # stands for -inf, which JSON cannot carry


@dataclass
class Lane:
    """The batcher of one (name, version, endpoint), and the engine it is bound to (the
    continuous batcher keeps per-model state; None for a batcher that takes any engine)."""

    batcher: Any
    engine: Engine | None


class Server:
    """The serving process's parts: routes, loaded models, batchers, prediction cache and
    metrics, with the one inference thread every model runs in."""

    def __init__(self, cfg: ServeConfig, router: Router, load: Callable[[ModelSource], Engine] | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.cfg = cfg
        self.router = router
        # serve.chat_template, read once (meshyard.serve.chat.configured_template); which
        # template a model answers chat requests with is meshyard.serve.chat.template_for's call.
        self.chat_template = chat_template
        self.metrics = ServeMetrics()
        # One thread: models run one batch at a time, and a batch uses every core itself.
        # torch.set_num_threads holds per thread: serve.threads is set on this one itself.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="meshyard-inference",
                                           initializer=_inference_threads, initargs=(cfg.threads,))
        self.models = ModelCache(load or (lambda source: load_engine(source, cfg.runtime, cfg.device, cfg.dtype)),
                                 budget_bytes=cfg.memory_budget_bytes, pinned=set(cfg.pinned),
                                 executor=self.executor, metrics=self.metrics, on_evict=self._drop_lanes,
                                 footprint=self.footprint)
        self.cache = open_cache(cfg.cache, cfg.cache_entries, cfg.cache_ttl_s)
        self.lanes: dict[tuple[str, str, str], Lane] = {}
        self._closing: set[asyncio.Task] = set()
        self.startup_problem = ""
        self.started_at = int(time.time())  # the "created" of the OpenAI model listing

    def footprint(self, engine: Engine) -> int:
        """The bytes a loaded model holds while it is loaded: its weights and buffers, and where
        it batches continuously the KV cache its batcher keeps (``max_batch_size`` sequences of
        its whole context: for a gpt2-124m shape in bf16 with 16 slots, 600 MB beside 250 MB of
        weights), counted from its loading on, even while it is asked for logits only. A dynamic
        batch's cache lives only while its batch runs and is not counted."""
        continuous, cache = self._continuous_cache(engine)
        if continuous and cache is None:
            log.warning("the KV cache of a %s could not be sized on the meta device; the memory budget counts "
                        "its weights only", type(engine.module).__name__)  # type: ignore[attr-defined]
        return int(engine.bytes) + (cache or 0)

    def _kv_cache_bytes(self, engine: Engine) -> int | None:
        """The bytes of the KV cache a continuous batcher of ``engine`` keeps, sized on the meta
        device; None where the model cannot size it there (found out when the cache is made)."""
        module = engine.module  # type: ignore[attr-defined]
        try:
            return module.init_kv_cache(self.cfg.max_batch_size, engine.context_length, device="meta").bytes
        except Exception:  # noqa: BLE001 - reported by the caller
            log.debug("sizing the KV cache of a %s on meta failed", type(module).__name__, exc_info=True)
            return None

    def _runs_continuously(self, engine: Engine) -> bool:
        """Whether ``engine``'s generate requests go to a continuous batcher (which keeps a KV
        cache for as long as the model is loaded)."""
        return self._continuous_cache(engine)[0]

    def _continuous_cache(self, engine: Engine) -> tuple[bool, int | None]:
        """Whether ``engine`` batches continuously, and then the bytes of the KV cache it keeps
        (None where they cannot be sized, and when it batches dynamically). Continuously: a
        model with a KV cache, asked for, or with ``auto`` on a CUDA device where that cache
        takes at most ``AUTO_KV_SHARE`` of the device's memory (a long context times
        ``max_batch_size`` sequences can take more than the device has, where a dynamic
        batch's cache is sized to its own requests). Each model is judged alone: several on
        one device share it through ``memory_budget_bytes``."""
        if not _has_kv_cache(engine) or self.cfg.scheduler == "dynamic":
            return False, None
        if self.cfg.scheduler == "auto" and not _on_cuda(engine):
            return False, None
        cache = self._kv_cache_bytes(engine)
        if self.cfg.scheduler == "continuous":
            return True, cache
        if cache is not None and cache <= AUTO_KV_SHARE * device_memory(engine.device):  # type: ignore[attr-defined]
            return True, cache
        return False, None

    def pinned_sources(self) -> list[ModelSource]:
        """Every version of the pinned names."""
        return [source for source, _ in self.router.listing() if source.name in self.cfg.pinned]

    @property
    def ready(self) -> bool:
        """Whether every pinned model is loaded (pinned models are never evicted; one that
        failed at startup and loads later on a request makes the server ready then)."""
        return all(self.models.loaded(source) for source in self.pinned_sources())

    async def start(self) -> None:
        """Loads the pinned models; the server is ready once they are."""
        try:
            await self.models.preload(self.pinned_sources())
        except Exception as exc:  # reported by /readyz and the log; requests still try again
            self.startup_problem = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            log.exception("loading the pinned models failed")

    async def close(self) -> None:
        """Stops the batchers, closes the prediction cache and the inference thread."""
        for lane in self.lanes.values():
            await lane.batcher.close()
        await self.cache.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def lane(self, source: ModelSource, endpoint: str, engine: Engine) -> Lane:
        """The batcher of ``source``'s ``endpoint``, created on first use."""
        key = (source.name, source.version, endpoint)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = self._new_lane(source, endpoint, engine)
        return lane

    def _drop_lanes(self, model: tuple[str, str]) -> None:
        """An evicted model's batchers go with it: a continuous batcher holds the engine and
        its KV cache. They are idle (a request holds its model in use until answered)."""
        for key in [key for key in self.lanes if key[:2] == model]:
            closing = asyncio.get_running_loop().create_task(self.lanes.pop(key).batcher.close())
            self._closing.add(closing)  # held until done, or the loop may drop the task
            closing.add_done_callback(self._closing.discard)

    def _new_lane(self, source: ModelSource, endpoint: str, engine: Engine) -> Lane:
        cfg, name, version = self.cfg, source.name, source.version

        def on_queue_wait(seconds: float) -> None:
            self.metrics.observe_queue_wait(name, version, endpoint, seconds)

        continuous = endpoint == "generate" and self._runs_continuously(engine)
        if endpoint == "generate":
            log.info("%s version %s: generate requests batched %s (serve.scheduler = %r)", name, version,
                     "continuously" if continuous else "dynamically", cfg.scheduler)
        if continuous:
            def on_step(size: int, seconds: float, new_tokens: int) -> None:
                self.metrics.observe_batch(name, version, endpoint, size, seconds, new_tokens)

            batcher = ContinuousBatcher(engine, max_batch_size=cfg.max_batch_size, max_queue=cfg.max_queue,
                                        executor=self.executor, on_step=on_step, on_queue_wait=on_queue_wait)
            return Lane(batcher, engine)

        def on_batch(items: list[Any], seconds: float) -> None:
            new_tokens = sum(item.sampling.max_new_tokens for item in items) if endpoint == "generate" else 0
            self.metrics.observe_batch(name, version, endpoint, len(items), seconds, new_tokens)

        run = run_generate if endpoint == "generate" else run_logits
        batcher = DynamicBatcher(run, max_batch_size=cfg.max_batch_size, max_wait_ms=cfg.max_wait_ms,
                                 max_queue=cfg.max_queue, executor=self.executor, on_batch=on_batch,
                                 on_queue_wait=on_queue_wait)
        return Lane(batcher, None)


def _inference_threads(threads: int) -> None:
    """``serve.threads`` for the inference thread (0 keeps torch's default)."""
    if threads > 0:
        torch.set_num_threads(threads)


def device_memory(device: torch.device) -> int:
    """Bytes of memory of a CUDA device."""
    return torch.cuda.get_device_properties(device).total_memory


def _on_cuda(engine: Engine) -> bool:
    """Whether ``engine`` computes on a CUDA device (exports run on the CPU)."""
    device = getattr(engine, "device", None)
    return isinstance(device, torch.device) and device.type == "cuda"


def _has_kv_cache(engine: Engine) -> bool:
    """Whether the continuous batcher can drive ``engine`` (a module with the KV-cache
    protocol); other models fall back to the dynamic batcher."""
    module = getattr(engine, "module", None)
    return module is not None and supports_kv_cache(module)


def run_logits(items: list[tuple[Engine, list[int], int]]) -> list[Any]:
    """One logits batch (in the inference thread): per item, its log-probabilities as a list,
    or its ``top_k`` best [id, log-probability] pairs."""
    engine = items[0][0]
    logprobs = torch.log_softmax(engine.next_token_logits([sequence for _, sequence, _ in items]), dim=-1)
    logprobs = torch.nan_to_num(logprobs, neginf=LOWEST_LOGPROB)
    answers: list[Any] = []
    for row, (_, _, top_k) in zip(logprobs, items):
        if top_k:
            values, ids = torch.topk(row, top_k)
            answers.append([[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())])
        else:
            answers.append(row.tolist())
    return answers


@dataclass
class Exchange:
    """One request on its way: the labels its metrics get once they are known (empty until
    the router found the model, so that made-up names never become label values)."""

    endpoint: str
    model: str = ""
    version: str = ""


Work = Callable[[Server, Request, Exchange], Awaitable[dict[str, Any] | Response]]


async def answer(server: Server, request: Request, endpoint: str, work: Work,
                 errors: Callable[[ServeError], Response] | None = None) -> Response:
    """Runs ``work`` for a model endpoint and turns its result (a JSON object, or a response
    such as a stream) or failure into a response, the failure through ``errors`` (default
    ``error_response``), recording the request's metrics; nothing raised here reaches uvicorn."""
    started = time.monotonic()
    exchange = Exchange(endpoint)
    errors = errors or error_response
    with server.metrics.in_flight():
        try:
            result = await work(server, request, exchange)
            response = result if isinstance(result, Response) else JSONResponse(result)
        except ServeError as exc:
            response = errors(exc)
            if isinstance(exc, ReadTimeout):
                response.headers["Connection"] = "close"
            reason = rejection(exc)
            if reason is not None:
                server.metrics.rejected(exchange.model, exchange.version, reason)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            response = errors(ServeError("the server failed to answer this request (an internal error, logged "
                                         "with its traceback); try again, and report it if it persists"))
    if exchange.version:
        response.headers[VERSION_HEADER] = exchange.version
    server.metrics.observe_request(exchange.model, exchange.version, endpoint, response.status_code,
                                   time.monotonic() - started)
    return response


def rejection(exc: ServeError) -> str | None:
    """How the rejected_total metric names a refusal; None for those it does not count
    (an unknown model, a model that cannot be loaded)."""
    if isinstance(exc, QueueFull):
        return "queue_full"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, BadRequest):
        return "bad_request"
    return "disconnected" if isinstance(exc, ClientDisconnected) else None


def error_response(exc: ServeError) -> JSONResponse:
    """``{"error": message}`` with the error's status (and Retry-After for a full queue)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)


def disconnect_check(request: Request) -> DisconnectCheck:
    """How a batcher asks whether ``request``'s client left: its connection's ``ClientLink``,
    read at once, where the server gives one (``meshyard serve`` does); else Starlette's
    check, which must be awaited."""
    link = client_link(request.scope)
    return request.is_disconnected if link is None else link.gone


async def request_payload(server: Server, request: Request, example: str) -> dict[str, Any]:
    """The request's JSON object, read and parsed within the server's limits (``read_payload``)."""
    return await read_payload(request.headers, _body_chunks(request), server.cfg, example)


async def _body_chunks(request: Request) -> AsyncIterator[bytes]:
    """The body as it arrives; a client that closes its connection halfway is a
    ``ClientDisconnected`` like one that leaves while its request waits."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise ClientDisconnected("the client closed its connection before its request's body arrived") from None


def _choose(server: Server, request: Request, exchange: Exchange) -> ModelSource:
    source = server.router.choose(request.path_params["name"], request.headers.get(VERSION_HEADER) or None)
    exchange.model, exchange.version = source.name, source.version
    return source


async def _cached(server: Server, exchange: Exchange, key: str) -> dict[str, Any] | None:
    found = await server.cache.get(key)
    server.metrics.cache_lookup(exchange.model, exchange.version, exchange.endpoint, found is not None)
    return None if found is None else {**found, "cached": True}


async def generate(server: Server, request: Request, exchange: Exchange) -> dict[str, Any]:
    """``POST /v1/models/{name}/generate``."""
    source = _choose(server, request, exchange)
    payload = await request_payload(server, request, GENERATE_EXAMPLE)
    call = parse_generate(payload, source, server.cfg)
    deadline = time.monotonic() + call.timeout_s
    key = cache_key(source.name, source.version, "generate", call.cache_payload()) \
        if call.sampling.deterministic else None
    if key is not None and (found := await _cached(server, exchange, key)) is not None:
        return found
    async with server.models.use(source) as engine:
        if not engine.supports_generate:
            raise BadRequest(f"model '{source.name}' gives next-token distributions only and cannot generate; "
                             f"ask POST /v1/models/{source.name}/logits instead")
        lane = server.lane(source, "generate", engine)
        item = (call.tokens, call.sampling) if lane.engine is not None \
            else DynamicGenerateItem(engine, call.tokens, call.sampling)
        tokens = await lane.batcher.submit(item, deadline, disconnect_check(request))
    result: dict[str, Any] = {"model": source.name, "version": source.version, "tokens": tokens}
    if source.tokenizer is not None:
        result["text"] = source.tokenizer.decode(tokens)
    if key is not None:
        await server.cache.put(key, result)
    return {**result, "cached": False}


async def logits(server: Server, request: Request, exchange: Exchange) -> dict[str, Any]:
    """``POST /v1/models/{name}/logits``: each sequence waits in the batcher as one item."""
    source = _choose(server, request, exchange)
    payload = await request_payload(server, request, LOGITS_EXAMPLE)
    call = parse_logits(payload, source, server.cfg)
    deadline = time.monotonic() + call.timeout_s
    key = cache_key(source.name, source.version, "logits", call.cache_payload())
    if (found := await _cached(server, exchange, key)) is not None:
        return found
    async with server.models.use(source) as engine:
        batcher = server.lane(source, "logits", engine).batcher
        gone = disconnect_check(request)
        rows = await all_or_none([batcher.submit((engine, sequence, call.top_k), deadline, gone)
                                  for sequence in call.sequences])
    result = {"model": source.name, "version": source.version, ("top" if call.top_k else "logprobs"): rows}
    await server.cache.put(key, result)
    return {**result, "cached": False}


async def all_or_none(waits: list[Awaitable[Any]]) -> list[Any]:
    """The results of ``waits``, run together; the first failure cancels the others (their
    items leave the queue) and is raised."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def models(server: Server, request: Request) -> Response:
    """``GET /v1/models``: every served version, whether it is loaded, its bytes and share;
    beside them OpenAI's list of the served names (``object`` and ``data``)."""
    listed = [{"name": source.name, "version": source.version, "loaded": server.models.loaded(source),
               "bytes": server.models.bytes_of(source), "pinned": source.name in server.cfg.pinned,
               "weight": weight} for source, weight in server.router.listing()]
    openai = [{"id": name, "object": "model", "created": server.started_at, "owned_by": "meshyard"}
              for name in server.router.names()]
    return JSONResponse({"models": listed, "object": "list", "data": openai})


async def readyz(server: Server, request: Request) -> Response:
    """200 once the pinned models are loaded, else 503 saying what it waits for."""
    if server.ready:
        return JSONResponse({"ready": True})
    waiting = ", ".join(sorted(server.cfg.pinned))
    problem = server.startup_problem or f"the pinned models ({waiting}) are still loading"
    return JSONResponse({"error": f"not ready: {problem}"}, status_code=503)


async def metrics(server: Server, request: Request) -> Response:
    """The Prometheus text of every metric."""
    body, content_type = server.metrics.render()
    return Response(body, media_type=content_type)
