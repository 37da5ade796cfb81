"""Prediction caches: keys, the in-process LRU, and Redis (a real redis-server on loopback,
started once for the module; the Redis tests skip with the reason where it cannot start)."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator

import pytest

from meshyard.serve.prediction_cache import (REDIS_PREFIX, MemoryCache, NoCache, RedisCache, cache_key,
                                             open_cache)
from tests.serve.redis import free_port, start_redis

ANSWER = {"model": "gpt", "version": "step-40.1a2b3c", "tokens": [5, 6, 7], "text": "abc", "cached": False}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    url, stop = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop()


def run(coro) -> object:  # noqa: ANN001
    return asyncio.run(asyncio.wait_for(coro, 30.0))


def test_cache_keys_are_canonical_and_tell_versions_and_endpoints_apart():
    payload = {"tokens": [1, 2, 3], "temperature": 0.0, "top_k": 0, "max_new_tokens": 4, "seed": None}
    key = cache_key("gpt", "step-40.1a2b3c", "generate", payload)
    assert len(key) == 64 and int(key, 16) >= 0
    assert key == cache_key("gpt", "step-40.1a2b3c", "generate", dict(reversed(payload.items())))
    others = {cache_key("gpt", "step-80.4d5e6f", "generate", payload),
              cache_key("gpt", "step-40.1a2b3c", "logits", payload),
              cache_key("mlp", "step-40.1a2b3c", "generate", payload),
              cache_key("gpt", "step-40.1a2b3c", "generate", {**payload, "tokens": [1, 2, 4]}),
              cache_key("gpt", "step-40.1a2b3c", "generate", {**payload, "max_new_tokens": 5})}
    assert len(others) == 5 and key not in others


def test_the_memory_cache_keeps_the_most_recently_used_entries():
    cache = MemoryCache(entries=2)

    async def main() -> tuple[dict | None, dict | None, dict | None]:
        await cache.put("a", {"n": 1})
        await cache.put("b", {"n": 2})
        assert await cache.get("a") == {"n": 1}  # a is now the most recent: b goes first
        await cache.put("c", {"n": 3})
        return await cache.get("a"), await cache.get("b"), await cache.get("c")

    assert run(main()) == ({"n": 1}, None, {"n": 3})
    assert len(cache) == 2


def test_a_hit_is_a_copy_the_caller_may_change():
    cache = MemoryCache(entries=4)

    async def main() -> dict | None:
        await cache.put("k", dict(ANSWER))
        hit = await cache.get("k")
        hit["cached"] = True
        hit["tokens"].append(99)
        return await cache.get("k")

    assert run(main()) == ANSWER


def test_open_cache_knows_its_forms_and_names_them_otherwise():
    assert isinstance(open_cache("memory", 8, 60.0), MemoryCache)
    assert isinstance(open_cache("off", 8, 60.0), NoCache)
    assert run(NoCache().get("anything")) is None
    with pytest.raises(ValueError) as refused:
        open_cache("memcached://127.0.0.1", 8, 60.0)
    assert "'memory'" in str(refused.value) and "'off'" in str(refused.value) and "redis://" in str(refused.value)
    with pytest.raises(ValueError, match="at least 1 entry"):
        open_cache("memory", 0, 60.0)


def test_redis_round_trip_is_shared_between_clients_and_expires(redis_url):
    from redis import asyncio as redis_asyncio

    async def main() -> tuple[dict | None, dict | None, int, int]:
        replica_a, replica_b = RedisCache(redis_url, ttl_s=60.0), RedisCache(redis_url, ttl_s=0.0)
        raw = redis_asyncio.from_url(redis_url)
        try:
            missing = await replica_a.get("k1")
            await replica_a.put("k1", ANSWER)
            seen_by_b = await replica_b.get("k1")  # another replica, another connection
            await replica_b.put("k2", ANSWER)
            ttl_ms = await raw.pttl(REDIS_PREFIX + "k1")
            forever = await raw.pttl(REDIS_PREFIX + "k2")
        finally:
            await replica_a.close()
            await replica_b.close()
            await raw.aclose()
        assert replica_a.errors == replica_b.errors == 0
        return missing, seen_by_b, ttl_ms, forever

    missing, seen_by_b, ttl_ms, forever = run(main())
    assert missing is None and seen_by_b == ANSWER
    assert 0 < ttl_ms <= 60_000  # the entry expires after ttl_s
    assert forever == -1  # ttl_s 0: no expiry of its own


def test_open_cache_opens_redis_urls(redis_url):
    cache = open_cache(redis_url, 8, 60.0)
    assert isinstance(cache, RedisCache) and cache.ttl_s == 60.0
    run(cache.close())


def test_a_dead_redis_is_a_miss_logged_once_and_never_an_error(caplog):
    cache = RedisCache(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60.0, retry_s=0.0)

    async def main() -> list[dict | None]:
        results = []
        for _ in range(3):
            await cache.put("k", ANSWER)
            results.append(await cache.get("k"))
        await cache.close()
        return results

    with caplog.at_level(logging.WARNING, logger="meshyard.serve.prediction_cache"):
        assert run(main()) == [None, None, None]
    assert cache.errors == 6  # every call tried Redis (retry_s 0) and counted as a miss
    warnings = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warnings) == 1


def test_a_redis_that_stops_turns_hits_into_misses(tmp_path):
    url, stop = start_redis(tmp_path)
    cache = RedisCache(url, ttl_s=60.0)

    async def main() -> tuple[dict | None, dict | None, dict | None]:
        await cache.put("k", ANSWER)
        before = await cache.get("k")
        stop()
        after = await cache.get("k")
        resting = await cache.get("k")  # within retry_s: not even tried
        await cache.close()
        return before, after, resting

    try:
        assert run(main()) == (ANSWER, None, None)
    finally:
        stop()
    assert cache.errors == 1
