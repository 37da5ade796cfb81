"""Canary releases, the model cache's memory budget and a prediction cache shared through
Redis, each against real ``meshyard serve`` processes.

``canary`` serves a trained model with a second version taking 30% of its traffic, and a
user's model beside them, under a budget that holds two of the three, generating with the
continuous scheduler; ``replicas`` are two servers of one model sharing a real redis-server.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshyard.inference.loading import describe, load_engine
from meshyard.inference.sampling import Sampling
from tests.serve.redis import start_redis
from tests.serve.servers import ServerProcess, concurrently, running_servers

CANARY_WEIGHT = 0.3
MAX_BATCH_SIZE = 4  # slots of each tiny's continuous batch, whose KV cache the budget counts
REQUESTS = 2000
LOGITS = "/v1/models/tiny/logits"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(trained_run: Path, second_run: Path, custom_model_run: Path) -> dict[str, Any]:
    """The served models loaded in this process: what the server must answer, and their sizes."""
    return {"tiny": load_engine(describe(str(trained_run))), "canary": load_engine(describe(str(second_run))),
            "other": load_engine(describe(str(custom_model_run)))}


@pytest.fixture(scope="module")
def budget(trained_run: Path, custom_model_run: Path, engines: dict[str, Any]) -> int:
    """Room for both versions of tiny, or for one of them and the other model, never all three.

    The model cache makes room for a model before loading it by its estimate (its checkpoint's
    tensors) and keeps it by what it holds once loaded (under the continuous scheduler, its
    weights and its batch's KV cache), so the budget lies between what both tinys hold
    (loading the second beside the first also needs its estimate free) and what loading the
    other model needs beside both."""
    tiny, other = describe(str(trained_run)), describe(str(custom_model_run))
    tiny_bytes = engines["tiny"].bytes + engines["tiny"].module.init_kv_cache(MAX_BATCH_SIZE, device="meta").bytes
    low = max(tiny_bytes + tiny.estimated_bytes, 2 * tiny_bytes)
    high = 2 * tiny_bytes + other.estimated_bytes
    assert engines["other"].bytes + tiny_bytes < low < high, (tiny_bytes, tiny.estimated_bytes, other)
    return (low + high) // 2


@pytest.fixture(scope="module")
def canary(tmp_path_factory, trained_run, second_run, custom_model_run, budget) -> ServerProcess:
    args = [f"tiny={trained_run}", f"other={custom_model_run}", "--canary", f"tiny={second_run}:{CANARY_WEIGHT}",
            f"--serve.memory_budget_bytes={budget}", "--scheduler", "continuous", "--serve.threads=1",
            f"--serve.max_batch_size={MAX_BATCH_SIZE}"]
    with running_servers(tmp_path_factory.mktemp("canary"), [args]) as (server,):
        yield server


@pytest.fixture(scope="module")
def versions(trained_run, second_run) -> tuple[str, str]:
    """(main version, canary version) of tiny."""
    return describe(str(trained_run)).version, describe(str(second_run)).version


def listing(server: ServerProcess) -> dict[tuple[str, str], dict]:
    models = httpx.get(f"{server.url}/v1/models", timeout=60.0).json()["models"]
    return {(m["name"], m["version"]): m for m in models}


def test_the_canary_takes_its_share_of_traffic(canary, versions):
    main, new = versions
    listed = listing(canary)
    assert listed[("tiny", main)]["weight"] == pytest.approx(1 - CANARY_WEIGHT)
    assert listed[("tiny", new)]["weight"] == pytest.approx(CANARY_WEIGHT)
    for version in (main, new):  # loaded one after the other: the budget holds both
        _use(canary, "tiny", version, token=5)
    replies = concurrently(canary.url, [(LOGITS, {"sequences": [[5, 5]], "top_k": 1}, {})] * REQUESTS,
                           concurrency=4)
    assert all(r.status_code == 200 for r in replies), canary.explain(replies[0])
    served = Counter(r.headers["X-Model-Version"] for r in replies)
    assert set(served) == {main, new}
    assert abs(served[new] / REQUESTS - CANARY_WEIGHT) <= 0.05, served
    # Each version answers with its own weights, the same every time (from the cache after the first).
    answers = {version: {r.text.replace('"cached":true', '"cached":false') for r in replies
                         if r.headers["X-Model-Version"] == version} for version in served}
    assert all(len(texts) == 1 for texts in answers.values()) and answers[main] != answers[new]
    for version, count in served.items():  # every figure is labelled by version (+1: the first request)
        assert canary.metric("meshyard_serve_request_seconds_count", model="tiny", version=version,
                             endpoint="logits", code="200") == count + 1


def _use(server: ServerProcess, model: str, version: str, token: int) -> None:
    """A request the prediction cache cannot answer, so the model itself must be loaded."""
    reply = httpx.post(f"{server.url}/v1/models/{model}/logits", json={"sequences": [[token, token]], "top_k": 1},
                       headers={"X-Model-Version": version}, timeout=60.0)
    assert reply.status_code == 200, server.explain(reply)


def _loaded(server: ServerProcess) -> dict[tuple[str, str], int]:
    return {key: m["bytes"] for key, m in listing(server).items() if m["loaded"]}


def test_idle_models_are_evicted_to_stay_within_the_budget(canary, versions, budget, custom_model_run):
    main, new = versions
    other = ("other", describe(str(custom_model_run)).version)
    for token, version in enumerate((main, new), start=40):
        _use(canary, "tiny", version, token)
    assert set(_loaded(canary)) == {("tiny", main), ("tiny", new)}
    evictions = canary.metric("meshyard_serve_model_evictions_total")
    _use(canary, *other, token=42)
    loaded = _loaded(canary)
    assert other in loaded and len(loaded) == 2 and sum(loaded.values()) <= budget
    evicted = ({("tiny", main), ("tiny", new)} - set(loaded)).pop()
    assert canary.metric("meshyard_serve_model_evictions_total") == evictions + 1
    assert canary.metric("meshyard_serve_model_evictions_total", model="tiny", version=evicted[1]) >= 1
    _use(canary, *evicted, token=43)  # loaded again, something else makes room
    loaded = _loaded(canary)
    assert evicted in loaded and len(loaded) == 2 and sum(loaded.values()) <= budget
    assert canary.metric("meshyard_serve_model_evictions_total") == evictions + 2


def test_the_continuous_scheduler_answers_each_request_as_the_model_alone(canary, versions, engines):
    by_version = dict(zip(versions, (engines["tiny"], engines["canary"])))
    labels = {"model": "tiny", "endpoint": "generate"}
    steps = canary.metric("meshyard_serve_batch_size_count", **labels)
    # Both versions and back: with the budget's evictions, a version may come back as a new engine.
    for round_, version in enumerate((versions[0], versions[1], versions[0])):
        prompts = [[60 + round_, 61 + i] for i in range(6)]
        calls = [("/v1/models/tiny/generate", {"tokens": p, "max_new_tokens": 3 + 2 * i},
                  {"X-Model-Version": version}) for i, p in enumerate(prompts)]
        replies = concurrently(canary.url, calls)
        assert all(r.status_code == 200 for r in replies), canary.explain(replies[0])
        alone = [by_version[version].generate([p], [Sampling(max_new_tokens=3 + 2 * i)])[0]
                 for i, p in enumerate(prompts)]
        assert [r.json()["tokens"] for r in replies] == alone
    assert canary.metric("meshyard_serve_batch_size_count", **labels) > steps


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> str:
    url, stop = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, trained_run, redis_url) -> list[ServerProcess]:
    args = [str(trained_run), "--cache", redis_url, "--serve.threads=1"]
    with running_servers(tmp_path_factory.mktemp("replicas"), [args, args]) as started:
        yield started


def test_a_replica_answers_from_the_shared_redis_cache_without_running_the_model(replicas):
    first, second = replicas
    body = {"prompt": "shared between replicas", "max_new_tokens": 6}
    computed = httpx.post(f"{first.url}/v1/models/tiny/generate", json=body, timeout=60.0)
    assert computed.status_code == 200, first.explain(computed)
    reused = httpx.post(f"{second.url}/v1/models/tiny/generate", json=body, timeout=60.0)
    assert reused.status_code == 200, second.explain(reused)
    assert computed.json()["cached"] is False
    assert reused.json() == {**computed.json(), "cached": True}
    assert reused.headers["X-Model-Version"] == computed.headers["X-Model-Version"]
    generate = {"model": "tiny", "endpoint": "generate"}
    assert first.metric("meshyard_serve_cache_misses_total", **generate) == 1
    assert second.metric("meshyard_serve_cache_hits_total", **generate) == 1
    # The second replica never loaded the model nor ran a batch.
    assert second.metric("meshyard_serve_model_loads_total") == 0
    assert second.metric("meshyard_serve_batch_size_count") == 0
    assert second.metric("meshyard_serve_generated_tokens_total") == 0
    assert first.metric("meshyard_serve_generated_tokens_total", **generate) == 6
