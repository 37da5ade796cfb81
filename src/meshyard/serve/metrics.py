"""The server's Prometheus metrics, in a registry of their own (``GET /metrics``).

Every name starts with ``meshyard_serve_``. Request, queue, batch, token and cache figures
carry the labels ``model``, ``version`` and ``endpoint`` so that a canary is compared with
its main version; ``in_flight_requests`` has none, as it is what an autoscaler reads per pod.
Latency percentiles (p50/p95/p99) come from the histograms' buckets, e.g.
``histogram_quantile(0.99, rate(meshyard_serve_request_seconds_bucket[5m]))``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from meshyard.extras import require

PREFIX = "meshyard_serve_"

# Seconds from a millisecond answer to a long generation on CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
REJECT_REASONS = ("queue_full", "deadline", "disconnected", "bad_request")

_PER_ENDPOINT = ("model", "version", "endpoint")
_PER_MODEL = ("model", "version")


class ServeMetrics:
    """All the server's figures; each method records one event."""

    def __init__(self) -> None:
        client = require("prometheus_client", "meshyard serve's /metrics")
        self._client = client
        self.registry = client.CollectorRegistry()
        histogram, counter, gauge = self._histogram, self._counter, self._gauge
        self.request_seconds = histogram("request_seconds", "Seconds from a request's arrival to its answer.",
                                         (*_PER_ENDPOINT, "code"), LATENCY_BUCKETS)
        self.queue_wait_seconds = histogram("queue_wait_seconds", "Seconds a request waited in its batcher's "
                                            "queue before its batch started running.", _PER_ENDPOINT,
                                            LATENCY_BUCKETS)
        self.batch_size = histogram("batch_size", "Requests run together in one batch.", _PER_ENDPOINT,
                                    BATCH_BUCKETS)
        self.generated_tokens = counter("generated_tokens", "New tokens generated.", _PER_ENDPOINT)
        self.tokens_per_second = gauge("tokens_per_second", "New tokens per second of the last batch.",
                                       _PER_ENDPOINT)
        self.cache_hits = counter("cache_hits", "Requests answered from the prediction cache.", _PER_ENDPOINT)
        self.cache_misses = counter("cache_misses", "Cacheable requests the prediction cache did not hold.",
                                    _PER_ENDPOINT)
        self.rejected_requests = counter("rejected", "Requests refused or dropped, by reason (" +
                                         ", ".join(REJECT_REASONS) + ").", ("model", "version", "reason"))
        self.in_flight_requests = gauge("in_flight_requests", "Requests being answered now (the autoscaling "
                                        "metric).", ())
        self.model_loads = counter("model_loads", "Models loaded into memory.", _PER_MODEL)
        self.model_evictions = counter("model_evictions", "Models evicted to stay within the memory budget.",
                                       _PER_MODEL)
        self.model_bytes = gauge("model_bytes", "Bytes of each loaded model's parameters and buffers.", _PER_MODEL)
        self.load_seconds = gauge("load_seconds", "Seconds the last load of each model took (warm-up included).",
                                  _PER_MODEL)

    def _histogram(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Any:
        return self._client.Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...]) -> Any:
        return self._client.Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...]) -> Any:
        return self._client.Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def observe_request(self, model: str, version: str, endpoint: str, code: int, seconds: float) -> None:
        """One answered request (any status code), its latency from arrival."""
        self.request_seconds.labels(model, version, endpoint, str(code)).observe(seconds)

    def observe_queue_wait(self, model: str, version: str, endpoint: str, seconds: float) -> None:
        """How long one request waited in the queue before its batch ran."""
        self.queue_wait_seconds.labels(model, version, endpoint).observe(seconds)

    def observe_batch(self, model: str, version: str, endpoint: str, size: int, seconds: float,
                      new_tokens: int) -> None:
        """One batch that ran: its size, its running time and the tokens it generated."""
        self.batch_size.labels(model, version, endpoint).observe(size)
        if new_tokens:
            self.generated_tokens.labels(model, version, endpoint).inc(new_tokens)
            if seconds > 0:
                self.tokens_per_second.labels(model, version, endpoint).set(new_tokens / seconds)

    def cache_lookup(self, model: str, version: str, endpoint: str, hit: bool) -> None:
        """One prediction-cache lookup (a Redis error counts as a miss)."""
        (self.cache_hits if hit else self.cache_misses).labels(model, version, endpoint).inc()

    def rejected(self, model: str, version: str, reason: str) -> None:
        """A request refused or dropped; ``reason`` is one of ``REJECT_REASONS``."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"rejection reason '{reason}' is not one of {', '.join(REJECT_REASONS)}")
        self.rejected_requests.labels(model, version, reason).inc()

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts a request in ``in_flight_requests`` while the block runs."""
        with self.in_flight_requests.track_inprogress():
            yield

    def model_loaded(self, model: str, version: str, bytes_: int, seconds: float) -> None:
        """A model version was loaded (and warmed up) in ``seconds``; it now holds ``bytes_``."""
        self.model_loads.labels(model, version).inc()
        self.model_bytes.labels(model, version).set(bytes_)
        self.load_seconds.labels(model, version).set(seconds)

    def model_evicted(self, model: str, version: str) -> None:
        """A model version left memory: counted, and its bytes no longer reported."""
        self.model_evictions.labels(model, version).inc()
        try:
            self.model_bytes.remove(model, version)
        except KeyError:  # never reported as loaded
            pass

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (e.g. ``value("model_loads_total", model="m",
        version="v")``), 0.0 when it was never recorded; for tests and the benchmark."""
        found = self.registry.get_sample_value(PREFIX + name, labels)
        return 0.0 if found is None else found

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return self._client.generate_latest(self.registry), self._client.CONTENT_TYPE_LATEST
