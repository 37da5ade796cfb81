"""Dynamic batching: requests that arrive close together run as one batch.

A ``DynamicBatcher`` keeps a bounded queue of items and one worker task on the event loop.
The worker waits for a batch to fill: it cuts a batch as soon as ``max_batch_size`` items
wait, or when the oldest waiting item has waited ``max_wait_ms`` (the wait starts when an
item enters an empty queue, so at low traffic a request waits at most ``max_wait_ms``).
Just before cutting it drops the items that can no longer be answered: those past their
deadline (their callers get ``DeadlineExceeded``) and those whose client went away (their
callers get ``ClientDisconnected``). The batch then runs in the executor, off the event
loop; only one batch per batcher is in flight, so requests that arrive meanwhile gather
into the next one. An exception from ``run_batch`` fails the items of that batch only.

Queue wait. Each item's queue wait is the time from ``submit`` to the moment its batch
started running in the executor (so it includes time spent behind other models' batches on
the shared inference thread). The batcher reports it in two ways:

- ``on_queue_wait(seconds)``, a constructor hook called once per item that ran, on the event
  loop, before the item's caller resumes: the server passes
  ``lambda s: metrics.observe_queue_wait(model, version, endpoint, s)``;
- ``submit_timed(...)``, which returns a ``Batched`` with the result, the queue wait and the
  size of the batch the item ran in (``submit`` returns the result alone).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, Sequence, TypeVar

from meshyard.serve.types import DeadlineExceeded, QueueFull, ServeError, Unavailable

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)

DisconnectCheck = Callable[[], "bool | Awaitable[bool]"]
"""Whether a request's client went away: answered at once, or when awaited."""

SHUTTING_DOWN = "the server is shutting down; send the request to another replica or try again later"


class ClientDisconnected(ServeError):
    """The client went away before its batch ran; its item was dropped (nobody reads the answer)."""

    status = 499  # the status proxies log for a client that closed the connection


@dataclass(frozen=True)
class Batched(Generic[R]):
    """What ``submit_timed`` returns: the item's result, how long it waited in the queue and
    how many items its batch held."""

    result: R
    queue_wait_s: float
    batch_size: int


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    item: T
    deadline: float
    is_disconnected: DisconnectCheck | None
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    queue_wait_s: float = 0.0
    batch_size: int = 0


class DynamicBatcher(Generic[T, R]):
    """Runs ``run_batch(items) -> results`` (one result per item, same order) on batches of
    submitted items; ``on_batch(items, seconds)`` is called after each batch that ran (for
    metrics), ``on_queue_wait(seconds)`` once per item that ran (see the module docstring)."""

    def __init__(self, run_batch: Callable[[list[T]], list[R]], *, max_batch_size: int, max_wait_ms: float,
                 max_queue: int, executor: Executor, on_batch: Callable[[list[T], float], None] | None = None,
                 on_queue_wait: Callable[[float], None] | None = None) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError(f"a batcher needs max_batch_size >= 1, max_queue >= 1 and max_wait_ms >= 0; got "
                             f"{max_batch_size}, {max_queue} and {max_wait_ms}")
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.executor = executor
        self.on_batch = on_batch
        self.on_queue_wait = on_queue_wait
        self._queue: deque[_Pending[T, R]] = deque()
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._running: list[_Pending[T, R]] = []  # the batch in the executor
        self._closed = False
        self._last_batch_s = 0.0  # for the Retry-After estimate

    @property
    def waiting(self) -> int:
        """Items in the queue now (not counting the batch that runs)."""
        return len(self._queue)

    async def submit(self, item: T, deadline: float,
                     is_disconnected: DisconnectCheck | None = None) -> R:
        """The result of ``item``, once its batch ran. ``deadline`` is a ``time.monotonic()``
        instant; raises ``QueueFull`` (max_queue items wait), ``DeadlineExceeded``,
        ``ClientDisconnected`` (``is_disconnected()`` said so before the batch was cut),
        ``Unavailable`` (the batcher closed) or what ``run_batch`` raised for this batch."""
        return (await self.submit_timed(item, deadline, is_disconnected)).result

    async def submit_timed(self, item: T, deadline: float,
                           is_disconnected: DisconnectCheck | None = None) -> Batched[R]:
        """Like ``submit``, with the item's queue wait and its batch's size."""
        pending = self._enqueue(item, deadline, is_disconnected)
        try:
            await asyncio.wait_for(asyncio.shield(pending.future), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            # An answer that came in the same instant the wait ran out still counts.
            if not pending.future.done():
                self._abandon(pending, DeadlineExceeded(self._deadline_message(pending)))
        except asyncio.CancelledError:  # the caller gave up (e.g. its request task was cancelled)
            self._abandon(pending, None)
            raise
        return Batched(pending.future.result(), pending.queue_wait_s, pending.batch_size)

    async def close(self) -> None:
        """Stops the worker; items still waiting, and those of a batch still running (it
        finishes in the executor, unread), get ``Unavailable``."""
        self._closed = True
        for pending in [*self._queue, *self._running]:
            self._settle(pending, Unavailable(SHUTTING_DOWN))
        self._queue.clear()
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    def _enqueue(self, item: T, deadline: float, is_disconnected: DisconnectCheck | None,
                 ) -> _Pending[T, R]:
        if self._closed:
            raise Unavailable(SHUTTING_DOWN)
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"{len(self._queue)} requests already wait for this model (serve.max_queue = "
                            f"{self.max_queue}); retry after the Retry-After delay, or add replicas",
                            retry_after_s=self._retry_after_s())
        loop = asyncio.get_running_loop()
        pending: _Pending[T, R] = _Pending(item, deadline, is_disconnected, loop.create_future())
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(self._deadline_message(pending))
        self._queue.append(pending)
        self._start_worker(loop)
        self._arrived.set()
        return pending

    def _start_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._work(), name="meshyard-batcher")
            self._worker.add_done_callback(_log_crash)

    def _retry_after_s(self) -> int:
        """Whole seconds until the queue has likely drained enough to take a request."""
        batches_ahead = math.ceil(len(self._queue) / self.max_batch_size)
        return max(1, math.ceil(batches_ahead * max(self._last_batch_s, self.max_wait_s)))

    def _deadline_message(self, pending: _Pending[T, R]) -> str:
        waited = time.monotonic() - pending.enqueued_at
        return (f"the request was not answered before its deadline ({waited:.3f} s after it was queued); "
                f"send a larger timeout_ms (at most serve.request_timeout_s), retry when the server is less "
                f"busy, or add replicas")

    def _abandon(self, pending: _Pending[T, R], error: BaseException | None) -> None:
        """The caller stops waiting: the item leaves the queue if it is still there."""
        # Asked first, not caught: deque.remove's ValueError formats the missing item's repr
        # (its prompt, its engine), which cost a streamed answer more than its events did.
        if pending in self._queue:
            self._queue.remove(pending)
        # Else it was already cut into a batch (it may still run; its answer is dropped).
        if error is not None:
            self._settle(pending, error)
        elif not pending.future.done():
            pending.future.cancel()

    @staticmethod
    def _settle(pending: _Pending[T, R], outcome: object) -> None:
        """Sets the item's result, or its exception when ``outcome`` is one; once only."""
        if pending.future.done():
            return
        if isinstance(outcome, BaseException):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    async def _work(self) -> None:
        """The worker: wait for a batch to fill, cut it, run it; again."""
        while not self._closed:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._wait_to_fill()
            self._running = await self._cut()
            if self._running:
                await self._run(self._running)
            self._running = []

    async def _wait_to_fill(self) -> None:
        """Returns once max_batch_size items wait or the oldest has waited max_wait_ms."""
        while self._queue and len(self._queue) < self.max_batch_size:
            left = self._queue[0].enqueued_at + self.max_wait_s - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _cut(self) -> list[_Pending[T, R]]:
        """Up to max_batch_size items from the head of the queue that can still be answered."""
        batch: list[_Pending[T, R]] = []
        while self._queue and len(batch) < self.max_batch_size:
            candidates = [self._queue.popleft() for _ in range(min(self.max_batch_size - len(batch),
                                                                   len(self._queue)))]
            gone = await clients_gone([p.is_disconnected for p in candidates])
            now = time.monotonic()
            for pending, disconnected in zip(candidates, gone):
                if pending.future.done():  # its caller already stopped waiting
                    continue
                if now >= pending.deadline:
                    self._settle(pending, DeadlineExceeded(self._deadline_message(pending)))
                elif disconnected:
                    self._settle(pending, ClientDisconnected("the client disconnected before its request ran"))
                else:
                    batch.append(pending)
        return batch

    async def _run(self, batch: list[_Pending[T, R]]) -> None:
        """Runs one batch in the executor and answers its items."""
        items = [pending.item for pending in batch]
        loop = asyncio.get_running_loop()
        try:
            started, seconds, results = await loop.run_in_executor(self.executor, _timed, self.run_batch, items)
            if len(results) != len(items):
                raise RuntimeError(f"run_batch returned {len(results)} results for a batch of {len(items)} items")
        except Exception as exc:  # noqa: BLE001 - this batch's callers get it, the batcher lives on
            log.exception("a batch of %d items failed", len(items))
            for pending in batch:
                self._settle(pending, exc)
            return
        self._last_batch_s = seconds
        for pending in batch:
            pending.queue_wait_s = max(0.0, started - pending.enqueued_at)
            pending.batch_size = len(batch)
            call_hook(self.on_queue_wait, pending.queue_wait_s)
        call_hook(self.on_batch, items, seconds)
        for pending, result in zip(batch, results):
            self._settle(pending, result)


def _timed(run_batch: Callable[[list[T]], list[R]], items: list[T]) -> tuple[float, float, list[R]]:
    """Runs in the executor: (monotonic start, seconds, results)."""
    started = time.monotonic()
    results = run_batch(items)
    return started, time.monotonic() - started, list(results)


async def clients_gone(checks: Sequence[DisconnectCheck | None]) -> list[bool]:
    """Whether each request's client went away, by its check (None: no check). A check
    answers at once (the connection's ``ClientLink.gone``) or when awaited (Starlette's
    ``Request.is_disconnected``); the awaited ones are asked together, not one after another,
    and without any, nothing here yields to the event loop. A failing check keeps its request
    (its answer will simply not be delivered)."""
    answers: list[Any] = [_asked(check) for check in checks]
    waiting = [i for i, answer in enumerate(answers) if inspect.isawaitable(answer)]
    if waiting:
        for i, gone in zip(waiting, await asyncio.gather(*(_awaited(answers[i]) for i in waiting))):
            answers[i] = gone
    return [bool(answer) for answer in answers]


def _asked(check: DisconnectCheck | None) -> bool | Awaitable[bool]:
    if check is None:
        return False
    try:
        return check()
    except Exception:  # noqa: BLE001 - a broken check must not drop a live request
        log.debug("the disconnect check failed; keeping the request", exc_info=True)
        return False


async def _awaited(answer: Awaitable[bool]) -> bool:
    try:
        return bool(await answer)
    except Exception:  # noqa: BLE001
        log.debug("the disconnect check failed; keeping the request", exc_info=True)
        return False


def _log_crash(task: asyncio.Task) -> None:
    """A worker that died of a bug says so; the next submit starts a new one."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the batcher's worker stopped", exc_info=task.exception())


def call_hook(hook: Callable[..., None] | None, *args: object) -> None:
    """Metrics hooks must never fail the requests they describe."""
    if hook is None:
        return
    try:
        hook(*args)
    except Exception:  # noqa: BLE001
        log.exception("a batcher hook failed")
