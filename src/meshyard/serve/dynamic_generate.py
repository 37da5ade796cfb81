"""Generate requests through the dynamic batcher, answered whole or streamed as decoded.

The dynamic batcher runs a whole batch in one ``Engine.generate`` call on the inference
thread (``run_generate``). A streamed request carries a ``StepFeed`` in its
``DynamicGenerateItem``; the batch's ``generate`` call then gets a ``StepSender`` as its
``on_step`` callback (see ``meshyard.inference.decoding``), which after every step hands
the new tokens of the streamed rows to their feeds, on the event loop. ``streamed`` reads a
feed, so a reader sees the steps decoded since it last looked (a list of tokens per step:
several when the loop was slower than decoding, so they can go out in one write), then the
end (or the refusal or failure that ended it, from the batcher's answer).

A reader that stops (a stop string met, a client gone) marks its feed left: the sender
stops its row at the next step, so the rest of the batch runs without it, and the
batcher's answer for it is dropped without error.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

from meshyard.inference.engine import Engine
from meshyard.inference.sampling import Sampling
from meshyard.serve.inbox import Inbox


HANDOFF_TIMEOUT_S = 1.0  # a loop too busy to take a step that long: generation goes on regardless


class StepFeed:
    """The tokens of one streamed request, from the inference thread to its reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.steps: Inbox[list[int] | None] = Inbox()  # None: the answer is in
        self.left = False  # set by the reader on the loop, read by the inference thread


class StepSender:
    """The ``on_step`` callback of one batch whose items may carry feeds (None: a request
    that is answered whole). Runs on the inference thread: the event loop is woken once per
    step for all the batch's streamed rows, not once per row."""

    def __init__(self, feeds: Sequence[StepFeed | None]) -> None:
        self.feeds = list(feeds)
        self.loop = next(feed.loop for feed in self.feeds if feed is not None)

    def __call__(self, rows: list[int], tokens: list[int]) -> set[int]:
        parts = [(self.feeds[row], token) for row, token in zip(rows, tokens)
                 if self.feeds[row] is not None and not self.feeds[row].left]
        if parts and not self.loop.is_closed():  # closed: the server stopped, nobody reads
            # Wait (the GIL released) until the loop has taken the step: a generation running
            # on meanwhile holds the GIL between its kernels, and the loop, which gives the GIL
            # up at every poll, would get it back only each switch interval (5 ms): the
            # streams fell a whole batch behind and throughput dropped several-fold (measured).
            taken = threading.Event()
            self.loop.call_soon_threadsafe(_deliver, parts, taken)
            taken.wait(HANDOFF_TIMEOUT_S)
        return {row for row in rows if self.feeds[row] is not None and self.feeds[row].left}


@dataclass(frozen=True)
class DynamicGenerateItem:
    """One generate request in a dynamic batch: the engine of its lane (every item of a lane
    has the same one), its prompt, how to draw, and its feed when it is streamed."""

    engine: Engine
    prompt: list[int]
    sampling: Sampling
    feed: StepFeed | None = None


def run_generate(items: list[DynamicGenerateItem]) -> list[list[int]]:
    """One generate batch (in the inference thread). All items of a lane share one engine:
    each holds its model in use while it waits, so the model cannot be swapped meanwhile."""
    on_step = maybe_sender([item.feed for item in items])
    return items[0].engine.generate([item.prompt for item in items], [item.sampling for item in items], on_step)


def maybe_sender(feeds: Sequence[StepFeed | None]) -> StepSender | None:
    """A sender for a batch with at least one streamed item; None otherwise, so a batch
    that nobody streams pays nothing per step."""
    return StepSender(feeds) if any(feed is not None for feed in feeds) else None


def _deliver(parts: list[tuple[StepFeed, int]], taken: threading.Event) -> None:
    for feed, token in parts:
        feed.steps.put([token])
    # The readers just woken run first (the loop runs its callbacks in order).
    asyncio.get_running_loop().call_soon(taken.set)


async def streamed(submit: Callable[[StepFeed], Awaitable[list[int]]]) -> AsyncIterator[list[list[int]]]:
    """The new tokens of one request as its batch decodes them: at each wake, the steps
    decoded since the last (a list of token lists, one per step).

    ``submit(feed)`` puts the request, carrying ``feed``, into the dynamic batcher and
    returns its answer (all its tokens); its refusals and failures (full queue, deadline,
    disconnected, a failed batch) are raised here. Tokens of the answer that no step
    delivered (an engine that ignores ``on_step``) come as one last step. Closing the
    iterator early (``contextlib.aclosing``) stops the request's row at its batch's next
    step, or takes it out of the queue if its batch has not started."""
    feed = StepFeed(asyncio.get_running_loop())
    answer = asyncio.ensure_future(submit(feed))
    # The end comes after every step: each step's delivery was queued on the loop before
    # the batch's answer was, so one inbox carries both, in order, and a reader waits on it alone.
    answer.add_done_callback(lambda _: feed.steps.put(None))
    answer.add_done_callback(_retrieve)
    sent = 0
    try:
        while True:
            steps = await feed.steps.take()
            ended = None in steps
            steps = steps[: steps.index(None)] if ended else steps
            if steps:
                sent += sum(len(tokens) for tokens in steps)
                yield steps
            if ended:
                break
        rest = answer.result()[sent:]  # raises what ended the request
        if rest:
            yield [rest]
    finally:
        feed.left = True
        answer.cancel()  # before its batch ran: it leaves the queue; after: its answer is dropped


def _retrieve(answer: asyncio.Future) -> None:
    """An answer nobody reads (its reader left) must not be logged as an unread failure."""
    if not answer.cancelled():
        answer.exception()
