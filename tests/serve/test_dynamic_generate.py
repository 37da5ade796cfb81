"""Generate requests through the dynamic batcher, streamed at every step of their batch.

A real ``DynamicBatcher`` runs ``run_generate`` on a tiny GPT in a one-thread executor.
Assertions are on tokens and on the forwards the model ran, never on elapsed time (the
``asyncio.wait_for`` guard only turns a hang into a failure).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Awaitable, Iterator, TypeVar

import pytest
import torch

from meshyard.inference.engine import EagerEngine
from meshyard.inference.sampling import Sampling
from meshyard.models.gpt import GPT, GPTShape
from meshyard.serve.batching import DynamicBatcher
from meshyard.serve.dynamic_generate import DynamicGenerateItem, StepFeed, run_generate, streamed
from meshyard.serve.types import DeadlineExceeded

VOCAB, CONTEXT = 64, 64
HANG_GUARD_S = 30.0
T = TypeVar("T")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> EagerEngine:
    torch.manual_seed(0)
    return EagerEngine(GPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, n_layer=2, n_head=2, d_model=32)),
                       VOCAB, CONTEXT)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def run(scenario: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, HANG_GUARD_S))


def batcher_of(executor: ThreadPoolExecutor, max_wait_ms: float = 50.0) -> DynamicBatcher:
    return DynamicBatcher(run_generate, max_batch_size=4, max_wait_ms=max_wait_ms, max_queue=8, executor=executor)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def later(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


async def collect(batcher: DynamicBatcher, engine: EagerEngine, tokens: list[int], sampling: Sampling,
                  ) -> list[list[int]]:
    steps = streamed(lambda feed: batcher.submit(DynamicGenerateItem(engine, tokens, sampling, feed), later()))
    async with aclosing(steps):
        return [step async for ready in steps for step in ready]


def test_a_streamed_request_gets_a_token_per_step_equal_to_its_whole_answer(engine, executor):
    long_, short = Sampling(max_new_tokens=12), Sampling(max_new_tokens=5)
    alone = engine.generate([prompt(7, 1), prompt(3, 2)], [long_, short])

    async def scenario() -> tuple[list[list[int]], list[int]]:
        batcher = batcher_of(executor)
        try:
            # One batch: a streamed request beside one answered whole.
            return await asyncio.gather(collect(batcher, engine, prompt(7, 1), long_),
                                        batcher.submit(DynamicGenerateItem(engine, prompt(3, 2), short), later()))
        finally:
            await batcher.close()

    chunks, whole = run(scenario())
    assert chunks == [[token] for token in alone[0]]  # 12 steps, one token each
    assert whole == alone[1]


def test_a_reader_that_leaves_frees_its_row_at_the_next_step(engine, executor):
    """The streamed row stops once its reader leaves; the rest of its batch runs on."""
    rows_per_forward: list[int] = []
    leave = threading.Event()  # the reader left: the model lets the next step run

    def hold(module, args, output) -> None:
        rows_per_forward.append(args[0].shape[0])
        if len(rows_per_forward) == 2:  # the first decoding step ends once the reader has left
            leave.wait(HANG_GUARD_S)

    handle = engine.module.register_forward_hook(hold)

    async def scenario() -> list[int]:
        batcher = batcher_of(executor)
        steps = streamed(lambda feed: batcher.submit(
            DynamicGenerateItem(engine, prompt(5, 3), Sampling(max_new_tokens=40), feed), later()))
        mate = asyncio.ensure_future(batcher.submit(
            DynamicGenerateItem(engine, prompt(5, 4), Sampling(max_new_tokens=10)), later()))
        try:
            async with aclosing(steps):
                await anext(steps)
            leave.set()
            return await mate
        finally:
            await batcher.close()

    try:
        mate = run(scenario())
    finally:
        handle.remove()
    assert len(mate) == 10
    # The prefill of both (one forward: same length), at most one step of both rows (the
    # reader left during it, or already while the first step was handed over); then the
    # mate's remaining steps alone, not the 38 more the streamed row would have taken.
    assert rows_per_forward in ([2] + [1] * 9, [2, 2] + [1] * 8)


def test_a_deadline_that_passes_mid_stream_ends_it_with_the_refusal(engine, executor):
    def slow(module, args, output) -> None:
        time.sleep(0.05)

    handle = engine.module.register_forward_hook(slow)

    async def scenario() -> list[list[int]]:
        batcher = batcher_of(executor, max_wait_ms=0)
        got: list[list[int]] = []
        steps = streamed(lambda feed: batcher.submit(
            DynamicGenerateItem(engine, prompt(5, 5), Sampling(max_new_tokens=40), feed),
            later(0.5)))
        try:
            async with aclosing(steps):
                async for ready in steps:
                    got.extend(ready)
        finally:
            await batcher.close()
        return got

    try:
        with pytest.raises(DeadlineExceeded):
            run(scenario())
    finally:
        handle.remove()


def test_steps_that_are_ready_together_are_read_together_and_in_order():
    async def submit(feed: StepFeed) -> list[int]:
        feed.steps.put([7])
        feed.steps.put([8])  # both before the reader runs: a loop slower than decoding
        return [7, 8, 9]  # an engine that handed over no step for the last token

    async def scenario() -> list[list[list[int]]]:
        async with aclosing(streamed(submit)) as steps:
            return [ready async for ready in steps]

    assert run(scenario()) == [[[7], [8]], [[9]]]
