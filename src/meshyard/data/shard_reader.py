"""Reading a sharded corpus (``meshyard.data.shards``) through a bounded local cache.

``ShardedTokens`` stands where a token array stands (``TokenWindows`` slices and gathers
it). Its samples are read in spans of shards (``meshyard.data.sampling.SpanOrder``, still a
function of the seed and the global batch, never of the world size), or shuffled over the
whole corpus as any other source; either way a rank fetches only the shards its windows
fall in. ``ShardCache`` keeps fetched shards as files under a local folder, at most ``cache_bytes``
of them, evicting the least recently used (a shard read or named ahead counts as used);
``prefetch`` fetches shards on background threads, so that a later read finds them there:
the loader's sampler names each micro-batch it hands out and the next two steps' ones
(``GlobalBatchSampler.look_ahead``), so their shards download while the current step
trains. Fetches ahead of need run on threads of their own, so a read waits only for its own
shards; one of them still queued ahead is taken out of that queue. A read that must wait
for a fetch waits inside the loader, which the step breakdown counts as its data phase. The
cache's folder lives as long as the cache (``meshyard.data.reader_folders``).

Loader workers (``data.num_workers > 0``) read what their rank fetches: the sampler runs in
the rank's process, so its look-ahead fills the rank's folder, and a worker reads a shard
from there, waiting while the rank's fetch of it is under way (a ``.name.pending`` file
marks one). A worker fetches a shard itself, into a cache of its own inside the rank's
folder, only when the rank neither holds nor fetches it (evicted meanwhile, say), through
the store opened anew in the worker (an fsspec client made in the rank, s3fs's, refuses to
work in a forked child); so a rank downloads its share once, whatever the number of its
workers.

A fetch that fails is tried again (``FETCH_ATTEMPTS``, with a growing pause); a shard
whose digest does not match the index is fetched once more, then refused.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from meshyard.data.cache import DataSourceError, write_atomically
from meshyard.data.reader_folders import new_reader_folder, remove_abandoned, remove_folder
from meshyard.data.shards import ShardEntry, ShardIndex, ShardStore, digest

FETCH_ATTEMPTS = 4
"""Tries of one download before its error is final: object stores fail now and then."""
FIRST_PAUSE_S = 0.05
"""Pause before the second try; each later one doubles it."""
FETCH_THREADS = 2
"""Downloads at once for reads waiting now, and as many again for shards fetched ahead of need."""
PENDING_POLL_S = 0.002
"""How often a loader worker looks again for a shard its rank is fetching."""


class ShardCache:
    """Shards of one corpus as local files in ``folder``, at most ``cache_bytes`` of them (see
    the module docstring). The cache owns ``folder``: ``close`` removes it, and so does the
    garbage collector or the end of the process, whichever comes first."""

    def __init__(self, store: ShardStore, index: ShardIndex, folder: Path, cache_bytes: int) -> None:
        largest = max((s.tokens for s in index.shards), default=0) * index.element.itemsize
        if cache_bytes < largest:
            raise DataSourceError(
                f"data.cache_bytes = {cache_bytes} cannot hold one shard of {store.url} ({largest} bytes); raise "
                f"data.cache_bytes to at least {2 * largest} (two shards: one read, one fetched ahead)")
        self.store, self.index, self.cache_bytes = store, index, cache_bytes
        self._start_in_this_process(folder)

    def _start_in_this_process(self, folder: Path) -> None:
        """Empty bookkeeping, threads and a lock of this process's own, for ``folder``."""
        self.folder = folder
        self._owner = os.getpid()
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ahead = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="meshyard-shards-ahead")
        self._now = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="meshyard-shards-now")
        self._remove = weakref.finalize(self, remove_folder, folder, self._owner)
        self.rank_folder: Path | None = None  # in a loader worker: its rank's cache folder
        self.fetches = 0  # downloads done, retries included: what tests and stall reports count
        self.fetched_bytes = 0  # bytes those downloads brought

    def _here(self) -> None:
        """Start a cache of this process's own when it is not the one that made this one: a
        loader worker forked (or unpickled) from its rank inherits the rank's bookkeeping,
        but none of its threads, and must not delete files the rank reads. It reads the
        rank's files where it can (``_from_rank``), and opens the store anew for its own fetches."""
        if self._owner != os.getpid():
            rank_folder = self.folder
            self._start_in_this_process(new_reader_folder(rank_folder))
            self.rank_folder = rank_folder
            if not self.store.is_local:
                # Kept, never collected here: its clean-up belongs to the rank's event loop,
                # and run in this process it blocks for a second and touches the rank's sockets.
                self._rank_store = self.store
                self.store = self.store.reopened()

    def close(self) -> None:
        """Wait for fetches under way, then remove the cache's folder and what it holds."""
        if self._owner == os.getpid():  # else this process never used its copy
            for pool in (self._ahead, self._now):
                pool.shutdown(wait=True, cancel_futures=True)
            self._remove()

    def prefetch(self, entries: Iterable[ShardEntry], now: bool = False) -> None:
        """Start fetching ``entries`` not yet here, in the background; ``now``: a read waits
        for them (see ``_future``)."""
        self._here()
        if self.rank_folder is not None:
            return  # a loader worker reads what its rank fetches, one shard at a time (``get``)
        for entry in entries:
            self._future(entry, now)

    def get(self, entry: ShardEntry) -> np.ndarray:
        """The shard's tokens, fetched first when they are not here (waiting for a prefetch under way)."""
        self._here()
        if self.rank_folder is not None:
            tokens = self._from_rank(entry)
            if tokens is not None:
                return tokens
        while True:
            try:
                self._future(entry, now=True).result()
            except CancelledError:  # moved ahead of the queue by another read meanwhile
                continue
            with self._lock:
                if entry.name in self._resident:  # else a fetch for another read evicted it meanwhile
                    self._resident.move_to_end(entry.name)
                    # Read into memory now: an eviction by a later fetch may delete the file.
                    return np.fromfile(self.folder / entry.name, dtype=self.index.element)

    def _from_rank(self, entry: ShardEntry) -> np.ndarray | None:
        """In a loader worker: the shard from the rank's folder, waiting while the rank fetches
        it; None when the rank neither holds nor fetches it."""
        assert self.rank_folder is not None
        path, pending = self.rank_folder / entry.name, self.rank_folder / pending_name(entry.name)
        while True:
            try:
                return np.fromfile(path, dtype=self.index.element)  # written whole, checked, renamed into place
            except FileNotFoundError:
                if not pending.exists():
                    break
            time.sleep(PENDING_POLL_S)
        try:  # the fetch may have ended between the two looks
            return np.fromfile(path, dtype=self.index.element)
        except FileNotFoundError:
            return None

    @property
    def capacity(self) -> int:
        """How many of the largest shards fit in the cache at once (at least one)."""
        largest = max(s.tokens for s in self.index.shards) * self.index.element.itemsize
        return max(1, self.cache_bytes // max(largest, 1))

    def _future(self, entry: ShardEntry, now: bool = False) -> Future:
        """The fetch of ``entry``, started if need be. Fetches ahead of need queue on threads
        of their own, so a read waits only for its own shards (``now``): one still queued
        there is taken out and fetched at once."""
        with self._lock:
            if entry.name in self._resident:
                self._resident.move_to_end(entry.name)  # named for a read now or soon: keep it
                done: Future = Future()
                done.set_result(None)
                return done
            pending = self._pending.get(entry.name)
            if pending is not None and now and pending.cancel():
                pending = None
            if pending is None:
                if entry.name not in self._pending:  # loader workers wait for it (``_from_rank``)
                    (self.folder / pending_name(entry.name)).touch()
                pending = (self._now if now else self._ahead).submit(self._fetch, entry)
                self._pending[entry.name] = pending
            return pending

    def _fetch(self, entry: ShardEntry) -> None:
        try:
            data = self._download(entry)
            if digest(data) != entry.sha256:
                data = self._download(entry)  # a corrupted transfer is worth one more
                if digest(data) != entry.sha256:
                    raise DataSourceError(
                        f"shard {entry.name} of {self.store.url} does not match the digest in its index, twice in a "
                        "row: the stored file is damaged or was replaced after the index was written; prepare the "
                        f"corpus again with 'meshyard data prepare SOURCE --out {self.store.url}'")
            with self._lock:
                self._make_room(len(data))
                # Into the folder as it is: after ``close`` it is gone, and stays gone.
                write_atomically(self.folder / entry.name, data, make_parent=False)
                self._resident[entry.name] = len(data)
        finally:
            with self._lock:
                self._pending.pop(entry.name, None)
                (self.folder / pending_name(entry.name)).unlink(missing_ok=True)

    def _download(self, entry: ShardEntry) -> bytes:
        for attempt in range(FETCH_ATTEMPTS):
            try:
                data = self.store.read(entry.name)
                with self._lock:  # fetches run on several threads
                    self.fetches += 1
                    self.fetched_bytes += len(data)
                return data
            except OSError as exc:
                with self._lock:
                    self.fetches += 1
                if attempt == FETCH_ATTEMPTS - 1:
                    raise DataSourceError(
                        f"shard {entry.name} of {self.store.url} could not be fetched in {FETCH_ATTEMPTS} tries "
                        f"({exc}); check data.url, data.storage_options and the network") from None
                time.sleep(FIRST_PAUSE_S * 2 ** attempt)
        raise AssertionError("unreachable")

    def _make_room(self, size: int) -> None:
        """Delete least recently used shards until ``size`` more bytes fit (under the lock)."""
        while self._resident and sum(self._resident.values()) + size > self.cache_bytes:
            name, _ = self._resident.popitem(last=False)
            (self.folder / name).unlink(missing_ok=True)

    def __getstate__(self) -> dict[str, Any]:
        # A copy in a loader worker process starts a cache of its own at its first read (``_here``).
        state = self.__dict__.copy()
        for key in ("_lock", "_ahead", "_now", "_pending", "_remove", "_resident"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._owner = -1  # no process's: the first read makes it this process's


def pending_name(name: str) -> str:
    """The file that marks a fetch of shard ``name`` under way in a cache's folder."""
    return f".{name}.pending"


class ShardedTokens:
    """The token stream of a sharded corpus, indexed by global token offset like a 1-D
    array: ``tokens[a:b]`` and ``tokens[positions]`` (an integer array of any shape)."""

    def __init__(self, cache: ShardCache, length: int | None = None) -> None:
        self.cache = cache
        self.shards = cache.index.shards
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards])  # first offset of each shard, then the end
        self.dtype = cache.index.element
        self.length = int(self.starts[-1]) if length is None else length

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        """Remove the local cache (``ShardCache.close``); reading again is an error."""
        self.cache.close()

    def head(self, count: int) -> ShardedTokens:
        """The first ``count`` tokens, still fetched only when read."""
        return ShardedTokens(self.cache, min(count, self.length))

    def __getitem__(self, key: slice | np.ndarray) -> np.ndarray:
        if isinstance(key, slice):
            first, stop, step = key.indices(len(self))
            return self._gather(np.arange(first, stop, step, dtype=np.int64))
        return self._gather(np.asarray(key, dtype=np.int64))

    def shard_numbers(self, positions: np.ndarray) -> np.ndarray:
        """The number of the shard that holds each of ``positions`` (token offsets), in their shape."""
        return np.searchsorted(self.starts, positions, side="right") - 1

    def shards_of(self, positions: np.ndarray) -> list[int]:
        """The shards (their numbers) that hold ``positions``."""
        return np.unique(self.shard_numbers(positions.reshape(-1))).tolist()

    def prefetch(self, positions: np.ndarray) -> None:
        """Start fetching the shards that hold ``positions`` (token offsets) in the background,
        the first needed first, as many as half the cache holds: the other half keeps the
        shards being read from being evicted by what is fetched ahead of them."""
        order = self.shard_numbers(positions.reshape(-1))
        numbers = list(dict.fromkeys(order.tolist()))  # first need first, each once
        self.cache.prefetch(self.shards[k] for k in numbers[: max(1, self.cache.capacity // 2)])

    def _gather(self, positions: np.ndarray) -> np.ndarray:
        out = np.empty(positions.shape, dtype=self.dtype)
        owner = self.shard_numbers(positions)
        numbers = np.unique(owner).tolist()
        # The shards of this read in parallel, as many as the cache holds at once.
        self.cache.prefetch((self.shards[k] for k in numbers[: self.cache.capacity]), now=True)
        for k in numbers:  # one shard in memory at a time: the cache may hold fewer than a read spans
            here = owner == k
            out[here] = self.cache.get(self.shards[k])[positions[here] - self.starts[k]]
        return out


def open_shards(url: str, storage_options: dict[str, Any], cache_dir: Path, cache_bytes: int) -> ShardedTokens:
    """The corpus at ``url``, cached under ``cache_dir`` in a folder named by its index's digest."""
    store = ShardStore(url, storage_options)
    index = store.read_index()
    parent = cache_dir / "shards" / digest(index.to_json().encode())[:20]
    parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(parent)  # the folders of killed readers
    return ShardedTokens(ShardCache(store, index, new_reader_folder(parent), cache_bytes))
