"""Answers kept for identical requests: an in-process LRU, Redis shared by replicas, or none.

Only deterministic requests are cached (greedy or seeded sampling; logits always), under
``cache_key``: a digest of the model version, the endpoint and the request's input and
sampling fields, so a new version never answers from an old one's entries. Values are JSON
objects; both caches store them as JSON text, so a hit returns a fresh copy the caller may
change. A cache never fails a request: a Redis that is down or slow counts as a miss (logged
once per outage) and answers are simply not stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Protocol

from meshyard.config.checks import CACHE_SCHEMES
from meshyard.extras import require

log = logging.getLogger(__name__)

# Keys in a shared Redis are namespaced, so the cache can share a database with other data.
REDIS_PREFIX = "meshyard:serve:"
ACCEPTED = "'memory' (in-process LRU), 'off', or a Redis URL such as redis://127.0.0.1:6379/0"


def cache_key(name: str, version: str, endpoint: str, payload: dict) -> str:
    """sha256 (hex) of the canonical JSON of the model version, endpoint and ``payload`` (the
    input tokens or sequences and the sampling fields): equal requests give equal keys,
    whatever the order of the payload's fields."""
    canonical = json.dumps([name, version, endpoint, payload], sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class PredictionCache(Protocol):
    """Where answers of deterministic requests are kept."""

    async def get(self, key: str) -> dict | None: ...

    async def put(self, key: str, value: dict) -> None: ...

    async def close(self) -> None: ...


class NoCache:
    """Keeps nothing (``serve.cache = "off"``)."""

    async def get(self, key: str) -> dict | None:
        return None

    async def put(self, key: str, value: dict) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryCache:
    """The ``entries`` most recently used answers, in this process."""

    def __init__(self, entries: int) -> None:
        if entries < 1:
            raise ValueError(f"serve.cache_entries = {entries}: the in-process cache needs at least 1 entry; "
                             f"use serve.cache = 'off' for no cache")
        self.entries = entries
        self._items: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    async def get(self, key: str) -> dict | None:
        text = self._items.get(key)
        if text is None:
            return None
        self._items.move_to_end(key)
        return json.loads(text)

    async def put(self, key: str, value: dict) -> None:
        self._items[key] = json.dumps(value)
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    async def close(self) -> None:
        self._items.clear()


class RedisCache:
    """Answers in Redis at ``url``, shared by every replica that names it; each entry lives
    ``ttl_s`` seconds (0: until Redis evicts it). After a failure Redis is left alone for
    ``retry_s`` seconds, so a dead Redis costs no time per request."""

    def __init__(self, url: str, ttl_s: float, *, timeout_s: float = 0.5, retry_s: float = 2.0) -> None:
        redis_asyncio = require("redis.asyncio", f"serve.cache = '{url}'")
        self.url = url
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.errors = 0  # failed Redis calls, each answered as a miss or a skipped store
        self._down_until = 0.0
        self._down = False
        try:
            self._client = redis_asyncio.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError as exc:
            raise ValueError(f"serve.cache = '{url}' is not a Redis URL Redis accepts ({exc}); give one such as "
                             f"redis://127.0.0.1:6379/0") from None

    async def get(self, key: str) -> dict | None:
        if self._resting():
            return None
        try:
            text = await self._client.get(REDIS_PREFIX + key)
            value = None if text is None else json.loads(text)
        except Exception as exc:  # noqa: BLE001 - any Redis trouble is a miss, never a failed request
            self._failed(exc)
            return None
        self._recovered()
        return value if isinstance(value, dict) else None

    async def put(self, key: str, value: dict) -> None:
        if self._resting():
            return
        expiry: dict[str, Any] = {"px": max(1, int(self.ttl_s * 1000))} if self.ttl_s > 0 else {}
        try:
            await self._client.set(REDIS_PREFIX + key, json.dumps(value), **expiry)
        except Exception as exc:  # noqa: BLE001 - an answer not stored is only a later miss
            self._failed(exc)
            return
        self._recovered()

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception:  # noqa: BLE001 - closing a connection to a dead server may fail; nothing to do
            log.debug("closing the Redis client failed", exc_info=True)

    def _resting(self) -> bool:
        return self._down and time.monotonic() < self._down_until

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + self.retry_s
        if not self._down:
            log.warning("the Redis prediction cache at %s does not answer (%s: %s); requests are answered without "
                        "it until it does", self.url, type(exc).__name__, exc)
        self._down = True

    def _recovered(self) -> None:
        if self._down:
            log.warning("the Redis prediction cache at %s answers again", self.url)
        self._down = False


def open_cache(spec: str, entries: int, ttl_s: float) -> PredictionCache:
    """The cache ``spec`` names: "memory" (``entries`` answers), "off", or a Redis URL
    (entries living ``ttl_s`` seconds). Anything else raises ValueError naming the forms."""
    if spec == "memory":
        return MemoryCache(entries)
    if spec == "off":
        return NoCache()
    if spec.startswith(CACHE_SCHEMES):
        return RedisCache(spec, ttl_s)
    raise ValueError(f"serve.cache = '{spec}' is not a prediction cache; use {ACCEPTED}")
