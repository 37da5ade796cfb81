"""The model cache: one load per model however many requests wait, eviction order under a
memory budget, pinned and busy models kept, failed loads answered and retried.

Engines are small plain objects and loads a plain function on a real one-thread executor;
a settable clock stands for time, and each load moves it on by the model's load cost, so
idle times and load times, hence the eviction order, are exact.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from meshyard.inference.source import ModelSource
from meshyard.serve.metrics import ServeMetrics
from meshyard.serve.model_cache import ModelCache
from meshyard.serve.types import Unavailable

HANG_GUARD_S = 30.0


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TinyEngine:
    """An engine of ``bytes`` bytes that counts its warm-ups."""

    vocab_size = 8
    context_length = 4
    supports_generate = False

    def __init__(self, name: str, bytes_: int) -> None:
        self.name = name
        self.bytes = bytes_
        self.warm_ups = 0

    def warm_up(self) -> None:
        self.warm_ups += 1


class Loader:
    """Loads ``TinyEngine``s, each taking its model's ``cost`` seconds of the clock; models
    named in ``broken`` fail to load (``times`` how often)."""

    def __init__(self, clock: Clock, cost: dict[str, float] | None = None) -> None:
        self.clock = clock
        self.cost = cost or {}
        self.calls: list[str] = []
        self.broken: dict[str, int] = {}
        self.gate: threading.Event | None = None

    def __call__(self, source: ModelSource) -> TinyEngine:
        self.calls.append(source.name)
        if self.gate is not None:
            self.gate.wait(HANG_GUARD_S)
        self.clock.now += self.cost.get(source.name, 1.0)
        if self.broken.get(source.name, 0) > 0:
            self.broken[source.name] -= 1
            raise OSError(f"checkpoint of {source.name} is truncated")
        return TinyEngine(source.name, source.estimated_bytes)


def source(name: str, bytes_: int = 100, version: str = "step-1.abcdef") -> ModelSource:
    return ModelSource(path=f"/runs/{name}", name=name, version=version, vocab_size=8, context_length=4,
                       tokenizer=None, estimated_bytes=bytes_, config=None)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True)


def make(executor: ThreadPoolExecutor, clock: Clock, loader: Loader, budget: int = 0,
         pinned: set[str] | None = None, on_evict=None,  # noqa: ANN001
         footprint=None) -> tuple[ModelCache, ServeMetrics]:  # noqa: ANN001
    metrics = ServeMetrics()
    cache = ModelCache(loader, budget_bytes=budget, pinned=pinned or set(), executor=executor, metrics=metrics,
                       clock=clock, on_evict=on_evict, footprint=footprint)
    return cache, metrics


def run(coro) -> object:  # noqa: ANN001
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


async def touch(cache: ModelCache, *sources: ModelSource) -> None:
    for one in sources:
        async with cache.use(one):
            pass


def test_concurrent_first_use_loads_and_warms_up_once(executor):
    clock = Clock()
    loader = Loader(clock)
    loader.gate = threading.Event()
    cache, metrics = make(executor, clock, loader)
    model = source("a", 123)

    async def use_it() -> TinyEngine:
        async with cache.use(model) as engine:
            return engine

    async def main() -> list[TinyEngine]:
        users = [asyncio.ensure_future(use_it()) for _ in range(10)]
        await asyncio.sleep(0)
        assert not cache.loaded(model) and cache.bytes_of(model) == 123  # the estimate until loaded
        loader.gate.set()
        return await asyncio.gather(*users)

    engines = run(main())
    assert loader.calls == ["a"]
    assert all(engine is engines[0] for engine in engines) and engines[0].warm_ups == 1
    assert cache.loaded(model) and cache.bytes_of(model) == 123
    assert metrics.value("model_loads_total", model="a", version="step-1.abcdef") == 1
    assert metrics.value("model_bytes", model="a", version="step-1.abcdef") == 123


def test_eviction_takes_the_longest_idle_per_second_of_loading_first(executor):
    clock = Clock()
    loader = Loader(clock, cost={"costly": 10.0, "cheap": 1.0, "recent": 1.0, "d": 1.0, "e": 1.0})
    evicted: list[tuple[str, str]] = []
    cache, metrics = make(executor, clock, loader, budget=300, on_evict=evicted.append)
    costly, cheap, recent, d, e = (source(n) for n in ("costly", "cheap", "recent", "d", "e"))

    async def main() -> list[list[str]]:
        await touch(cache, costly, cheap, recent)
        clock.now += 100.0
        await touch(cache, recent)  # used just now: idle 0
        steps = []
        for new in (d, e):
            await touch(cache, new)
            steps.append([s.name for s in (costly, cheap, recent, d, e) if cache.loaded(s)])
        return steps

    steps = run(main())
    # d: cheap (idle 100 s / 1 s of loading) goes before costly (100 s / 10 s) and recent (0 s).
    # e: costly (101 s / 10 s) goes before recent (1 s / 1 s).
    assert steps == [["costly", "recent", "d"], ["recent", "d", "e"]]
    assert evicted == [("cheap", "step-1.abcdef"), ("costly", "step-1.abcdef")]  # the server drops their batchers
    assert cache.total_bytes == 300
    assert metrics.value("model_evictions_total", model="cheap", version="step-1.abcdef") == 1
    assert metrics.value("model_evictions_total", model="costly", version="step-1.abcdef") == 1
    assert metrics.registry.get_sample_value("meshyard_serve_model_bytes",
                                             {"model": "cheap", "version": "step-1.abcdef"}) is None


def test_pinned_and_busy_models_are_never_evicted(executor):
    clock = Clock()
    cache, _ = make(executor, clock, Loader(clock), budget=200, pinned={"pinned"})
    pinned, other, busy, late = (source(n) for n in ("pinned", "other", "busy", "late"))

    async def main() -> None:
        await cache.preload([pinned])
        await touch(cache, other)
        clock.now += 1000.0  # pinned is by far the longest idle: still it stays
        async with cache.use(busy):
            assert cache.loaded(pinned) and not cache.loaded(other)
            with pytest.raises(Unavailable) as refused:  # pinned + busy fill the budget
                await touch(cache, late)
            assert "pinned or answering requests" in refused.value.message
            assert "serve.memory_budget_bytes = 200" in refused.value.message
        await touch(cache, late)  # busy is idle now: it makes room
        assert cache.loaded(pinned) and cache.loaded(late) and not cache.loaded(busy)

    run(main())


def test_a_model_larger_than_the_whole_budget_is_unavailable(executor):
    clock = Clock()
    cache, _ = make(executor, clock, Loader(clock), budget=50)
    big = source("big", 80)

    async def main() -> None:
        with pytest.raises(Unavailable) as refused:
            await touch(cache, big)
        assert refused.value.status == 503
        assert "80 bytes, more than the whole memory budget" in refused.value.message

    run(main())
    assert not cache.loaded(big) and cache.total_bytes == 0


def test_a_failed_load_answers_every_waiter_and_is_retried_later(executor):
    clock = Clock()
    loader = Loader(clock)
    loader.broken["flaky"] = 1
    cache, metrics = make(executor, clock, loader)
    flaky = source("flaky")

    async def main() -> list[object]:
        first = await asyncio.gather(*(touch(cache, flaky) for _ in range(3)), return_exceptions=True)
        await touch(cache, flaky)  # the next request loads it again, and now it works
        return first

    first = run(main())
    assert all(isinstance(outcome, Unavailable) for outcome in first)
    message = first[0].message
    assert "could not be loaded from /runs/flaky" in message and "checkpoint of flaky is truncated" in message
    assert loader.calls == ["flaky", "flaky"] and cache.loaded(flaky)
    assert metrics.value("model_loads_total", model="flaky", version="step-1.abcdef") == 1


def test_versions_of_one_name_are_cached_apart(executor):
    clock = Clock()
    loader = Loader(clock)
    cache, _ = make(executor, clock, loader)
    old, new = source("m", version="step-1.aaaaaa"), source("m", version="step-2.bbbbbb")

    async def main() -> tuple[TinyEngine, TinyEngine]:
        async with cache.use(old) as first, cache.use(new) as second:
            return first, second

    first, second = run(main())
    assert first is not second and loader.calls == ["m", "m"]
    assert cache.loaded(old) and cache.loaded(new)


def test_what_serving_keeps_beside_a_model_counts_against_the_budget(executor):
    clock = Clock()
    # Each model keeps as much again beside its weights (a continuous batch's KV cache, say).
    cache, metrics = make(executor, clock, Loader(clock), budget=250, footprint=lambda engine: 2 * engine.bytes)
    first, second, big = source("first", 100), source("second", 100), source("big", 130)

    async def main() -> list[object]:
        await touch(cache, first)
        clock.now += 1.0
        await touch(cache, second)  # 200 + 200 would exceed 250: the idle first model goes
        seen = [cache.loaded(first), cache.loaded(second), cache.total_bytes, cache.bytes_of(second),
                metrics.registry.get_sample_value("meshyard_serve_model_bytes",
                                                  {"model": "second", "version": "step-1.abcdef"})]
        with pytest.raises(Unavailable, match="260 bytes, more than the whole memory budget"):
            await touch(cache, big)  # 130 bytes of weights alone would have fitted
        return seen

    assert run(main()) == [False, True, 200, 200, 200]
