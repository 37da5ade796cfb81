"""The dynamic batcher: what goes into each batch, and what is refused or dropped before one runs.

The batch function is a plain recording callable run on a real one-thread executor; a
``threading.Event`` holds a batch in the executor where a test needs requests to pile up
behind it. Assertions are on batch composition and outcomes, never on elapsed time (the
``asyncio.wait_for`` guards only turn a hang into a failure).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Iterator

import pytest

from meshyard.serve.batching import Batched, ClientDisconnected, DisconnectCheck, DynamicBatcher, clients_gone
from meshyard.serve.types import DeadlineExceeded, QueueFull, Unavailable

HANG_GUARD_S = 30.0  # far beyond any wait the tests allow; reaching it means the batcher hung
FOREVER_MS = 600_000.0  # a max_wait no test could sit through: a batch that leaves did not wait for it


class Recorder:
    """Doubles each item and records the batches it ran; ``hold`` keeps the next batch in the
    executor until ``release`` (to let requests pile up behind it)."""

    def __init__(self, fail_on: object = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.started = threading.Event()
        self._gate: threading.Event | None = None

    def hold(self) -> None:
        self._gate = threading.Event()
        self.started.clear()

    def release(self) -> None:
        assert self._gate is not None
        self._gate.set()
        self._gate = None

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        gate = self._gate
        self.started.set()
        if gate is not None:
            gate.wait(HANG_GUARD_S)
        if self.fail_on in items:
            raise ValueError(f"item {self.fail_on} broke the model")
        return [2 * item for item in items]


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True)


def later(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def run(coro: Awaitable) -> object:
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


async def until_running(recorder: Recorder, batcher: DynamicBatcher) -> None:
    """Waits until the held batch runs in the executor and the queue is empty again."""
    await asyncio.to_thread(recorder.started.wait, HANG_GUARD_S)
    assert batcher.waiting == 0


def make(recorder: Recorder, executor: ThreadPoolExecutor, **settings: object) -> DynamicBatcher[int, int]:
    options: dict = {"max_batch_size": 8, "max_wait_ms": FOREVER_MS, "max_queue": 64} | settings
    return DynamicBatcher(recorder, executor=executor, **options)


def test_concurrent_submits_run_as_one_full_batch_at_once(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=8)

    async def main() -> list[int]:
        return await asyncio.gather(*(batcher.submit(i, later()) for i in range(8)))

    assert run(main()) == [2 * i for i in range(8)]
    # One batch of all 8, although max_wait is ten minutes: a full batch does not wait.
    assert recorder.batches == [list(range(8))]


def test_a_full_batch_leaves_and_the_rest_waits_at_most_max_wait(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=4, max_wait_ms=20)

    async def main() -> list[int]:
        return await asyncio.gather(*(batcher.submit(i, later()) for i in range(6)))

    assert run(main()) == [2 * i for i in range(6)]
    # The first four fill a batch; the two left over run on their own once max_wait ends,
    # rather than waiting for a batch that never fills.
    assert recorder.batches == [[0, 1, 2, 3], [4, 5]]


def test_a_lone_request_runs_alone(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=8, max_wait_ms=10)

    async def main() -> tuple[int, int]:
        return await batcher.submit(1, later()), await batcher.submit(2, later())

    assert run(main()) == (2, 4)
    assert recorder.batches == [[1], [2]]


def test_requests_arriving_during_a_batch_form_the_next_batch(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=8, max_wait_ms=0)

    async def main() -> list[int]:
        recorder.hold()
        first = asyncio.ensure_future(batcher.submit(0, later()))
        await until_running(recorder, batcher)
        rest = [asyncio.ensure_future(batcher.submit(i, later())) for i in range(1, 6)]
        await asyncio.sleep(0)
        assert batcher.waiting == 5  # one batch per batcher in flight: the others queue
        recorder.release()
        return await asyncio.gather(first, *rest)

    assert run(main()) == [0, 2, 4, 6, 8, 10]
    assert recorder.batches == [[0], [1, 2, 3, 4, 5]]


def test_a_full_queue_answers_queue_full_with_retry_after(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=1, max_wait_ms=0, max_queue=2)

    async def main() -> list[int]:
        recorder.hold()
        running = asyncio.ensure_future(batcher.submit(0, later()))
        await until_running(recorder, batcher)
        queued = [asyncio.ensure_future(batcher.submit(i, later())) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await batcher.submit(3, later())
        assert refused.value.status == 503 and refused.value.retry_after_s >= 1
        assert "serve.max_queue = 2" in refused.value.message
        recorder.release()
        return await asyncio.gather(running, *queued)

    assert run(main()) == [0, 2, 4]
    assert recorder.batches == [[0], [1], [2]]  # the refused request never ran


def test_a_request_past_its_deadline_is_answered_504_and_never_runs(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=4, max_wait_ms=0)

    async def main() -> None:
        with pytest.raises(DeadlineExceeded):  # already past when it arrives
            await batcher.submit(7, time.monotonic() - 1)
        recorder.hold()
        running = asyncio.ensure_future(batcher.submit(0, later()))
        await until_running(recorder, batcher)
        with pytest.raises(DeadlineExceeded) as late:  # its deadline passes behind the held batch
            await batcher.submit(1, time.monotonic() + 0.05)
        assert late.value.status == 504 and "deadline" in late.value.message
        kept = asyncio.ensure_future(batcher.submit(2, later()))
        recorder.release()
        assert await running == 0 and await kept == 4

    run(main())
    assert recorder.batches == [[0], [2]]


@pytest.mark.parametrize("awaited", [True, False], ids=["awaited-check", "check-answered-at-once"])
def test_disconnected_clients_are_dropped_before_their_batch_runs(executor, awaited):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=4, max_wait_ms=0)
    asked: list[int] = []

    def client(item: int, gone: bool) -> DisconnectCheck:
        async def is_disconnected() -> bool:
            asked.append(item)
            return gone

        def gone_now() -> bool:  # a connection's ClientLink.gone
            asked.append(item)
            return gone
        return is_disconnected if awaited else gone_now

    async def main() -> list[object]:
        recorder.hold()
        running = asyncio.ensure_future(batcher.submit(0, later()))
        await until_running(recorder, batcher)
        waiting = [asyncio.ensure_future(batcher.submit(i, later(), client(i, gone=i == 2))) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        assert asked == []  # asked when the batch is cut, not while the request waits
        recorder.release()
        return await asyncio.gather(running, *waiting, return_exceptions=True)

    outcomes = run(main())
    assert outcomes[:2] == [0, 2] and outcomes[3] == 6
    assert isinstance(outcomes[2], ClientDisconnected)
    assert recorder.batches == [[0], [1, 3]]
    assert sorted(asked) == [1, 2, 3]


def test_a_failing_batch_fails_only_its_own_requests(executor):
    recorder = Recorder(fail_on=13)
    batcher = make(recorder, executor, max_batch_size=2)

    async def main() -> tuple[list[object], int]:
        failed = await asyncio.gather(batcher.submit(13, later()), batcher.submit(1, later()),
                                      return_exceptions=True)
        after = await asyncio.gather(batcher.submit(2, later()), batcher.submit(3, later()))
        return failed, after

    failed, after = run(main())
    assert all(isinstance(outcome, ValueError) and "item 13" in str(outcome) for outcome in failed)
    assert after == [4, 6]
    assert recorder.batches == [[13, 1], [2, 3]]


def test_a_batch_function_giving_too_few_results_fails_that_batch(executor):
    batcher = DynamicBatcher(lambda items: items[:1], max_batch_size=2, max_wait_ms=FOREVER_MS, max_queue=4,
                             executor=executor)

    async def main() -> list[object]:
        return await asyncio.gather(batcher.submit(1, later()), batcher.submit(2, later()), return_exceptions=True)

    outcomes = run(main())
    assert all(isinstance(outcome, RuntimeError) and "1 results for a batch of 2" in str(outcome)
               for outcome in outcomes)


def test_queue_wait_and_batches_are_reported(executor):
    recorder = Recorder()
    waits: list[float] = []
    batches: list[tuple[list[int], float]] = []
    batcher = make(recorder, executor, max_batch_size=4, max_wait_ms=0,
                   on_queue_wait=waits.append, on_batch=lambda items, seconds: batches.append((items, seconds)))

    async def main() -> tuple[Batched[int], list[Batched[int]], float]:
        recorder.hold()
        first = asyncio.ensure_future(batcher.submit_timed(0, later()))
        await until_running(recorder, batcher)
        queued = [asyncio.ensure_future(batcher.submit_timed(i, later())) for i in (1, 2)]
        await asyncio.sleep(0)
        held_from = time.monotonic()
        await asyncio.sleep(0.05)
        held_for = time.monotonic() - held_from
        recorder.release()
        return await first, list(await asyncio.gather(*queued)), held_for

    first, queued, held_for = run(main())
    assert (first.result, first.batch_size) == (0, 1)
    assert [(b.result, b.batch_size) for b in queued] == [(2, 2), (4, 2)]
    # Queued behind the held batch, they waited at least as long as it was held.
    assert all(b.queue_wait_s >= held_for for b in queued)
    assert waits == [first.queue_wait_s] + [b.queue_wait_s for b in queued]
    assert [items for items, _ in batches] == [[0], [1, 2]]
    assert all(seconds >= 0 for _, seconds in batches)


def test_a_failing_metrics_hook_does_not_fail_requests(executor):
    def broken(*_: object) -> None:
        raise RuntimeError("metrics down")

    batcher = make(Recorder(), executor, max_batch_size=1, on_queue_wait=broken, on_batch=broken)
    assert run(batcher.submit(5, later())) == 10


def test_close_answers_waiting_and_running_requests_unavailable(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=1, max_wait_ms=0)

    async def main() -> None:
        recorder.hold()
        running = asyncio.ensure_future(batcher.submit(0, later()))
        await until_running(recorder, batcher)
        waiting = asyncio.ensure_future(batcher.submit(1, later()))
        await asyncio.sleep(0)
        await batcher.close()
        recorder.release()
        for caller in (running, waiting):
            with pytest.raises(Unavailable, match="shutting down"):
                await caller
        with pytest.raises(Unavailable):
            await batcher.submit(2, later())

    run(main())
    assert recorder.batches == [[0]]


def test_bad_settings_are_refused(executor):
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        DynamicBatcher(Recorder(), max_batch_size=0, max_wait_ms=1, max_queue=1, executor=executor)


def test_clients_are_asked_at_once_or_together_and_a_failing_check_keeps_its_request():
    def broken() -> bool:
        raise OSError("the check failed")

    async def awaited_broken() -> bool:
        raise OSError("the check failed")

    async def gone_later() -> bool:
        await asyncio.sleep(0)
        return True

    checks = [None, lambda: True, lambda: False, broken, gone_later, awaited_broken]
    assert run(clients_gone(checks)) == [False, True, False, False, True, False]
    at_once = clients_gone([lambda: False, lambda: True])
    with pytest.raises(StopIteration) as finished:  # nothing to await: it never gave the event loop a turn
        at_once.send(None)
    assert finished.value.value == [False, True]


class Unprintable(int):
    """An item whose repr must never be made: a request's repr holds its prompt and engine."""

    def __repr__(self) -> str:
        raise AssertionError("the batcher formatted an item's repr")


def test_a_caller_that_stops_waiting_for_a_running_item_leaves_without_formatting_it(executor):
    recorder = Recorder()
    batcher = make(recorder, executor, max_batch_size=1, max_wait_ms=0)

    async def main() -> None:
        recorder.hold()
        running = asyncio.ensure_future(batcher.submit(Unprintable(3), later()))
        await until_running(recorder, batcher)
        running.cancel()  # a stream's reader that has all its tokens stops waiting for the answer
        with pytest.raises(asyncio.CancelledError):
            await running
        recorder.release()
        assert await batcher.submit(4, later()) == 8

    run(main())
