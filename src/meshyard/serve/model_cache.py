"""Several models in one process: loaded on first use, evicted to stay within a memory budget.

A model version (key: name and version) is loaded the first time a request needs it: the
``load`` function and the engine's ``warm_up`` run in the inference executor, once, however
many requests wait for it. When the loaded models would exceed ``budget_bytes``, idle ones
are evicted: never a pinned one (by name), never one that answers a request now, and among
the rest first the one with the highest ``idle_seconds / load_seconds``: long idle and cheap
to load again. A load that fails answers ``Unavailable`` with its cause to every request that
waited for it, and is tried again by the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from meshyard.serve.types import Unavailable

if TYPE_CHECKING:
    from meshyard.inference.engine import Engine
    from meshyard.inference.source import ModelSource
    from meshyard.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

Key = tuple[str, str]

# A load faster than this counts as this long, so that idle/load stays finite.
MIN_LOAD_SECONDS = 1e-3
# Times a request waits for a load before giving up when other loads keep evicting it.
_LOAD_ATTEMPTS = 3


@dataclass(eq=False)
class _Loaded:
    engine: Engine
    bytes: int
    load_seconds: float
    last_used: float
    in_use: int = 0


def _key(source: ModelSource) -> Key:
    return source.name, source.version


class ModelCache:
    """The loaded engines, by (name, version). ``budget_bytes`` 0 means no limit; ``clock``
    (monotonic seconds) times idleness and loads; ``on_evict(key)`` follows each eviction, so
    that whatever else holds the engine (a batcher bound to it) lets go of it too.
    ``footprint(engine)`` is what a loaded model counts against the budget (default: the
    engine's own bytes), so that what serving keeps beside it for as long as it is loaded
    counts too."""

    def __init__(self, load: Callable[[ModelSource], Engine], *, budget_bytes: int, pinned: set[str],
                 executor: Executor, metrics: ServeMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[Key], None] | None = None,
                 footprint: Callable[[Engine], int] | None = None) -> None:
        self._load_fn = load
        self._on_evict = on_evict
        self._footprint = footprint or (lambda engine: int(engine.bytes))
        self.budget_bytes = budget_bytes
        self.pinned = set(pinned)
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self._loaded: dict[Key, _Loaded] = {}
        self._loading: dict[Key, asyncio.Task] = {}
        self._reserved: dict[Key, int] = {}  # estimated bytes of the loads in progress

    @asynccontextmanager
    async def use(self, source: ModelSource) -> AsyncIterator[Engine]:
        """The engine of ``source``, loaded on first use; while the block runs it is in use and
        cannot be evicted. Raises ``Unavailable`` when it cannot be loaded or does not fit."""
        entry = await self._acquire(source)
        try:
            yield entry.engine
        finally:
            entry.in_use -= 1
            entry.last_used = self._clock()

    async def preload(self, sources: list[ModelSource]) -> None:
        """Loads ``sources`` (the pinned models, at start-up); raises the first failure after
        trying them all."""
        async def load_one(source: ModelSource) -> None:
            async with self.use(source):
                pass

        outcomes = await asyncio.gather(*(load_one(source) for source in sources), return_exceptions=True)
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            raise failures[0]

    def loaded(self, source: ModelSource) -> bool:
        """Whether ``source`` is in memory now."""
        return _key(source) in self._loaded

    def bytes_of(self, source: ModelSource) -> int:
        """The loaded engine's bytes, else the source's estimate."""
        entry = self._loaded.get(_key(source))
        return entry.bytes if entry is not None else source.estimated_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the loaded models together."""
        return sum(entry.bytes for entry in self._loaded.values())

    async def _acquire(self, source: ModelSource) -> _Loaded:
        """The loaded entry of ``source``, marked in use; loads it once for all who wait."""
        key = _key(source)
        for _ in range(_LOAD_ATTEMPTS):
            entry = self._loaded.get(key)
            if entry is not None:
                entry.in_use += 1
                entry.last_used = self._clock()
                return entry
            task = self._loading.get(key)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._load(source), name=f"load {key}")
                task.add_done_callback(_retrieve)
                self._loading[key] = task
            # Shielded: a waiter that gives up must not cancel the load the others wait for.
            await asyncio.shield(task)
        raise Unavailable(f"model '{source.name}' version '{source.version}' was evicted {_LOAD_ATTEMPTS} times "
                          f"right after loading, as other models need the memory; retry shortly, or raise "
                          f"serve.memory_budget_bytes")

    async def _load(self, source: ModelSource) -> None:
        """Loads and warms up ``source`` in the executor and admits it under the budget."""
        key = _key(source)
        try:
            self._make_room(source, source.estimated_bytes, strict=False)
            self._reserved[key] = source.estimated_bytes
            try:
                loop = asyncio.get_running_loop()
                engine, seconds = await loop.run_in_executor(self._executor, self._load_and_warm, source)
            except Exception as exc:  # noqa: BLE001 - any failure of a user's model is answered, not raised
                log.exception("loading %s version %s from %s failed", source.name, source.version, source.path)
                raise Unavailable(
                    f"model '{source.name}' version '{source.version}' could not be loaded from {source.path}: "
                    f"{type(exc).__name__}: {exc}. Fix the model files or the server's settings; the next "
                    f"request for this model tries to load it again.") from exc
            finally:
                del self._reserved[key]
            self._admit(source, engine, seconds)
        finally:
            del self._loading[key]

    def _load_and_warm(self, source: ModelSource) -> tuple[Engine, float]:
        """In the executor: load, one warm-up forward, and the seconds both took."""
        started = self._clock()
        engine = self._load_fn(source)
        engine.warm_up()
        return engine, self._clock() - started

    def _admit(self, source: ModelSource, engine: Engine, seconds: float) -> None:
        """Keeps a freshly loaded engine, evicting others to fit its real size."""
        size = int(self._footprint(engine))
        if self.budget_bytes > 0 and size > self.budget_bytes:
            raise Unavailable(
                f"model '{source.name}' version '{source.version}' takes {size} bytes, more than the whole "
                f"memory budget (serve.memory_budget_bytes = {self.budget_bytes}); raise the budget (0 means "
                f"no limit), serve a smaller export of it (e.g. meshyard export --int8), or, where it batches "
                f"continuously (its KV cache counts too), a smaller serve.max_batch_size or "
                f"serve.scheduler = 'dynamic'")
        self._make_room(source, size, strict=True)
        self._loaded[_key(source)] = _Loaded(engine, size, seconds, last_used=self._clock())
        self._metrics.model_loaded(source.name, source.version, size, seconds)
        log.info("loaded %s version %s (%d bytes) in %.2f s", source.name, source.version, size, seconds)

    def _make_room(self, source: ModelSource, needed: int, *, strict: bool) -> None:
        """Evicts until ``needed`` more bytes fit the budget; when nothing more can be evicted,
        raises ``Unavailable`` if ``strict``, else leaves it to the check after loading."""
        if self.budget_bytes <= 0:
            return
        while self.total_bytes + sum(self._reserved.values()) + needed > self.budget_bytes:
            victim = self._victim()
            if victim is None:
                if not strict:
                    return
                held = ", ".join(f"{name} {version}" for name, version in self._loaded) or "loads in progress"
                raise Unavailable(
                    f"model '{source.name}' version '{source.version}' needs {needed} bytes, but the memory "
                    f"budget (serve.memory_budget_bytes = {self.budget_bytes}) is held by models that are "
                    f"pinned or answering requests ({held}); retry shortly, raise the budget or pin fewer models")
            self._evict(victim)

    def _victim(self) -> Key | None:
        """The evictable model with the highest idle time per second of loading, if any."""
        now = self._clock()
        candidates = [(max(0.0, now - entry.last_used) / max(entry.load_seconds, MIN_LOAD_SECONDS), key)
                      for key, entry in self._loaded.items() if entry.in_use == 0 and key[0] not in self.pinned]
        return max(candidates)[1] if candidates else None

    def _evict(self, key: Key) -> None:
        entry = self._loaded.pop(key)
        self._metrics.model_evicted(*key)
        log.info("evicted %s version %s (%d bytes) to stay within the memory budget", *key, entry.bytes)
        if self._on_evict is not None:
            self._on_evict(key)


def _retrieve(task: asyncio.Task) -> None:
    """A load nobody awaits any more must not log 'exception never retrieved'."""
    if not task.cancelled():
        task.exception()
