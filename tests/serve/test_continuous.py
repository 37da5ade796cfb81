from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

import pytest
import torch

from meshyard.inference.engine import EagerEngine, generate_by_recomputing
from meshyard.inference.sampling import Sampling
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP
from meshyard.serve.batching import ClientDisconnected
from meshyard.serve.continuous import ContinuousBatcher
from meshyard.serve.types import BadRequest, DeadlineExceeded, QueueFull, Unavailable

VOCAB, CONTEXT = 64, 64
HANG_GUARD_S = 30.0  # far beyond any scenario here; reaching it means the batcher hung
T = TypeVar("T")
POISON = VOCAB - 1  # a prompt holding it makes FragileGPT's prefill fail


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FragileGPT(GPT):
    """meshyard's GPT, except that a prefill of a prompt holding POISON fails (a model error)."""

    def forward(self, tokens, cache=None, slots=None, positions=None):
        if cache is not None and tokens.shape[1] > 1 and bool((tokens == POISON).any()):
            raise RuntimeError("the model cannot take this token")
        return super().forward(tokens, cache=cache, slots=slots, positions=positions)


@pytest.fixture(scope="module")
def engine() -> EagerEngine:
    torch.manual_seed(0)
    module = FragileGPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, n_layer=2, n_head=2, d_model=32))
    return EagerEngine(module, VOCAB, CONTEXT)


@pytest.fixture(scope="module")
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def run(scenario: Awaitable[T]) -> T:
    """``scenario`` on a new event loop; a hang becomes a failure after ``HANG_GUARD_S``."""
    return asyncio.run(asyncio.wait_for(scenario, HANG_GUARD_S))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, POISON, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(engine: EagerEngine, tokens: list[int], sampling: Sampling) -> list[int]:
    """Unbatched generation by recomputing the prefix (the reference: no cache)."""
    with torch.inference_mode():
        return generate_by_recomputing(engine.forward, [tokens], [sampling], CONTEXT, VOCAB)[0]


class Steps:
    """Records on_step calls and runs actions registered for a given step number."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.new_tokens: list[int] = []
        self.actions: dict[int, Callable[[], None]] = {}

    def __call__(self, batch_size: int, seconds: float, new_tokens: int) -> None:
        self.sizes.append(batch_size)
        self.new_tokens.append(new_tokens)
        if (action := self.actions.pop(len(self.sizes), None)) is not None:
            action()


def later(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def finish_order(batcher: ContinuousBatcher, named: dict[str, tuple[list[int], Sampling]],
                 order: list[str]) -> dict[str, asyncio.Future]:
    """Submit each item as a task (on the running loop) that notes its name in ``order`` when
    its tokens arrive."""
    async def one(name: str, item: tuple[list[int], Sampling]) -> list[int]:
        tokens = await batcher.submit(item, later())
        order.append(name)
        return tokens
    return {name: asyncio.ensure_future(one(name, item)) for name, item in named.items()}


def test_tokens_equal_unbatched_greedy_for_requests_joining_at_different_steps(engine, executor):
    items = [(prompt(n, seed), Sampling(max_new_tokens=m)) for seed, (n, m) in
             enumerate([(5, 30), (17, 4), (1, 12), (30, 9), (8, 1), (2, 25), (12, 16)])]

    async def scenario() -> list[list[int]]:
        steps, waits = Steps(), []
        batcher = ContinuousBatcher(engine, max_batch_size=4, max_queue=16, executor=executor, on_step=steps,
                                    on_queue_wait=waits.append)
        tasks = [asyncio.ensure_future(batcher.submit(item, later())) for item in items[:3]]
        steps.actions[3] = lambda: tasks.extend(asyncio.ensure_future(batcher.submit(item, later()))
                                                for item in items[3:5])
        steps.actions[6] = lambda: tasks.extend(asyncio.ensure_future(batcher.submit(item, later()))
                                                for item in items[5:])
        while len(tasks) < len(items) or not all(task.done() for task in tasks):
            await asyncio.gather(*tasks)  # the list grows while the first ones run
        results = [task.result() for task in tasks]
        assert max(steps.sizes) == 4 and len(steps.sizes) < sum(s.max_new_tokens for _, s in items)
        assert sum(steps.new_tokens) == sum(s.max_new_tokens for _, s in items)
        assert batcher.running == batcher.waiting == 0
        assert len(waits) == len(items) and min(waits) >= 0
        return results

    results = run(scenario())
    assert results == [alone(engine, tokens, sampling) for tokens, sampling in items]


def test_short_requests_after_a_long_one_finish_first_through_a_reused_slot(engine, executor):
    named = {"long": (prompt(6, 1), Sampling(max_new_tokens=50))}
    named.update({f"short{i}": (prompt(3 + 4 * i, 10 + i), Sampling(max_new_tokens=3 + i)) for i in range(4)})

    async def scenario() -> tuple[list[str], dict[str, list[int]], list[int]]:
        steps, order = Steps(), []
        batcher = ContinuousBatcher(engine, max_batch_size=2, max_queue=8, executor=executor, on_step=steps)
        tasks = finish_order(batcher, {"long": named["long"]}, order)
        # The shorts arrive once the long one runs; with 2 slots they take turns in the second.
        shorts = {name: item for name, item in named.items() if name != "long"}
        steps.actions[2] = lambda: tasks.update(finish_order(batcher, shorts, order))
        await tasks["long"]
        await asyncio.gather(*tasks.values())
        return order, {name: task.result() for name, task in tasks.items()}, steps.sizes

    order, results, sizes = run(scenario())
    assert order == ["short0", "short1", "short2", "short3", "long"]
    assert max(sizes) == 2
    assert results == {name: alone(engine, *item) for name, item in named.items()}


def test_seeded_sampling_rows_draw_what_they_draw_alone(engine, executor):
    items = [(prompt(4, 20), Sampling(max_new_tokens=10, temperature=0.9, top_k=8, seed=1)),
             (prompt(9, 21), Sampling(max_new_tokens=6, temperature=1.2, seed=2)),
             (prompt(2, 22), Sampling(max_new_tokens=8))]

    async def scenario() -> list[list[int]]:
        batcher = ContinuousBatcher(engine, max_batch_size=3, max_queue=4, executor=executor)
        return await asyncio.gather(*(batcher.submit(item, later()) for item in items))

    assert run(scenario()) == [alone(engine, *item) for item in items]


def test_a_full_queue_refuses_and_the_accepted_requests_still_finish(engine, executor):
    long, next_ = (prompt(5, 30), Sampling(max_new_tokens=40)), (prompt(7, 31), Sampling(max_new_tokens=5))

    async def scenario() -> list[list[int]]:
        batcher = ContinuousBatcher(engine, max_batch_size=1, max_queue=1, executor=executor)
        first = asyncio.ensure_future(batcher.submit(long, later()))
        second = asyncio.ensure_future(batcher.submit(next_, later()))
        await asyncio.sleep(0)  # both are in: one takes the only slot, one waits
        with pytest.raises(QueueFull, match="serve.max_queue = 1") as refused:
            await batcher.submit(next_, later())
        assert refused.value.status == 503 and refused.value.retry_after_s >= 1
        return [await first, await second]

    assert run(scenario()) == [alone(engine, *long), alone(engine, *next_)]


def test_expired_and_disconnected_requests_leave_and_free_their_slot(engine, executor):
    long, short = (prompt(5, 40), Sampling(max_new_tokens=40)), (prompt(3, 41), Sampling(max_new_tokens=4))

    def gone_after(checks: int) -> Callable[[], Awaitable[bool]]:
        seen = []

        async def is_disconnected() -> bool:
            seen.append(1)
            return len(seen) > checks
        return is_disconnected

    async def scenario() -> list[list[int]]:
        steps = Steps()
        batcher = ContinuousBatcher(engine, max_batch_size=1, max_queue=4, executor=executor, on_step=steps)
        with pytest.raises(DeadlineExceeded, match="before its deadline"):
            await batcher.submit(short, time.monotonic())
        leaving = asyncio.ensure_future(batcher.submit(long, later(), gone_after(3)))
        waiting = asyncio.ensure_future(batcher.submit(short, later()))
        with pytest.raises(ClientDisconnected):
            await leaving
        tokens = await waiting  # it got the slot the disconnected row left
        assert len(steps.sizes) < 10 and batcher.running == batcher.waiting == 0
        expiring = asyncio.ensure_future(batcher.submit(long, time.monotonic() + 0.05))
        steps.actions[len(steps.sizes) + 2] = lambda: time.sleep(0.1)  # the deadline passes mid-generation
        with pytest.raises(DeadlineExceeded, match="tokens ready"):
            await expiring
        return [tokens, await batcher.submit(short, later())]

    assert run(scenario()) == [alone(engine, *short)] * 2


def test_a_stream_gives_each_steps_tokens_and_leaving_it_frees_the_slot(engine, executor):
    long, short = (prompt(5, 42), Sampling(max_new_tokens=30)), (prompt(3, 43), Sampling(max_new_tokens=4))

    async def scenario() -> tuple[list[list[int]], list[int], int]:
        steps = Steps()
        batcher = ContinuousBatcher(engine, max_batch_size=1, max_queue=4, executor=executor, on_step=steps)
        parts = [step async for ready in batcher.stream(short, later()) for step in ready]
        async with contextlib.aclosing(batcher.stream(long, later())) as leaving:
            await anext(leaving)  # the reader stops after the first step: a stop string met, a client gone
        before = len(steps.sizes)
        tokens = await batcher.submit(short, later())  # the slot is free at the next step
        return parts, tokens, len(steps.sizes) - before

    parts, tokens, steps_taken = run(scenario())
    assert [len(part) for part in parts] == [2, 1, 1]  # the prefilling step also decodes
    assert sum(parts, []) == tokens == alone(engine, *short)
    assert steps_taken == 3  # the short request's own steps only: the long one left at once


def test_bad_prompts_and_failing_forwards_fail_alone(engine, executor):
    good = (prompt(6, 50), Sampling(max_new_tokens=8))

    async def scenario() -> list[list[int]]:
        batcher = ContinuousBatcher(engine, max_batch_size=2, max_queue=4, executor=executor)
        with pytest.raises(BadRequest, match="more than this model's context of 64"):
            await batcher.submit((prompt(60, 51), Sampling(max_new_tokens=5)), later())
        with pytest.raises(BadRequest, match="outside this model's vocabulary"):
            await batcher.submit(([VOCAB], Sampling()), later())
        poisoned = asyncio.ensure_future(batcher.submit(([1, POISON, 2], Sampling(max_new_tokens=3)), later()))
        tokens = await batcher.submit(good, later())
        with pytest.raises(Unavailable, match="generation failed: the model cannot take this token"):
            await poisoned
        empty = await batcher.submit((prompt(3, 52), Sampling(max_new_tokens=0)), later())
        await batcher.close()
        with pytest.raises(Unavailable, match="shutting down"):
            await batcher.submit(good, later())
        return [tokens, empty]

    assert run(scenario()) == [alone(engine, *good), []]


def test_prompts_of_one_length_prefill_in_one_forward_and_a_failing_one_fails_alone(engine, executor):
    same = [(prompt(7, 60 + i), Sampling(max_new_tokens=3)) for i in range(3)]
    other = (prompt(4, 70), Sampling(max_new_tokens=3))
    poisoned = ([1, 2, 3, POISON, 4, 5, 6], Sampling(max_new_tokens=3))  # as long as ``same``
    prefills: list[int] = []
    forward = engine.module.forward

    def counted(tokens, cache=None, slots=None, positions=None):
        if tokens.shape[1] > 1:
            prefills.append(tokens.shape[0])
        return forward(tokens, cache=cache, slots=slots, positions=positions)

    async def scenario() -> list[object]:
        batcher = ContinuousBatcher(engine, max_batch_size=8, max_queue=8, executor=executor)
        first = await asyncio.gather(*(batcher.submit(item, later()) for item in [*same, other]))
        prefilled_together = list(prefills)
        prefills.clear()
        second = await asyncio.gather(*(batcher.submit(item, later()) for item in [same[0], poisoned, same[1]]),
                                      return_exceptions=True)
        return [first, prefilled_together, second]

    engine.module.forward = counted
    try:
        first, prefilled_together, second = run(scenario())
    finally:
        del engine.module.forward
    assert first == [alone(engine, *item) for item in [*same, other]]
    assert sorted(prefilled_together) == [1, 3]  # one forward per length
    assert second[0] == alone(engine, *same[0]) and second[2] == alone(engine, *same[1])
    assert isinstance(second[1], Unavailable) and "cannot take this token" in str(second[1])


def test_a_model_without_a_kv_cache_is_refused(executor):
    with pytest.raises(TypeError, match="does not implement the KV-cache protocol"):
        ContinuousBatcher(EagerEngine(MLP(VOCAB, d_model=8), VOCAB, CONTEXT), max_batch_size=2, max_queue=2,
                          executor=executor)


def test_a_stream_whose_deadline_passes_mid_step_ends_with_the_refusal_at_once(engine, executor):
    """The stream's own timer ends it while a slow step still runs (the batcher only checks
    deadlines between steps); the steps before the deadline were read."""
    forwards = []

    def slow_second_step(module, args, output) -> None:
        forwards.append(1)
        if len(forwards) == 3:  # the prefill and first decoding forward make the first step
            time.sleep(1.0)

    async def scenario() -> tuple[list[list[int]], float]:
        batcher = ContinuousBatcher(engine, max_batch_size=1, max_queue=4, executor=executor)
        got: list[list[int]] = []
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="tokens ready"):
            async for ready in batcher.stream((prompt(5, 60), Sampling(max_new_tokens=40)), started + 0.3):
                got.extend(ready)
        ended = time.monotonic() - started
        await batcher.close()
        return got, ended

    handle = engine.module.register_forward_hook(slow_second_step)
    try:
        got, ended = run(scenario())
    finally:
        handle.remove()
    assert [len(step) for step in got] == [2] and ended < 0.9  # the prefilling step only
