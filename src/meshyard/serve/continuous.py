"""Continuous (iteration-level) batching of generate requests over a KV cache.

A dynamic batch runs to its longest completion: a request for 4 tokens batched with one for
200 waits for the 200. Here the batch is re-formed between decoding steps instead. One
background task repeats:

1. drop rows whose caller is gone (deadline passed, client disconnected, caller cancelled)
   and free their cache slots;
2. admit waiting requests into free slots (at most ``max_batch_size`` run at once), each
   prefilled into its slot, which gives its first token;
3. one decoding forward for every running row that needs more tokens;
4. finish the rows that have their ``max_new_tokens``: their callers get the tokens at once
   and their slots go to the next waiting requests.

``stream`` gives a request's tokens as each step makes them (the steps made since its reader
last looked, each a list); a caller that stops reading (a stop string met, a client gone)
gives up its slot before the next step.

Each step runs in the server's inference executor, never on the event loop. A row's tokens
are what ``generate`` gives for it alone, greedy and sampled (each row draws from its own
generator): batched forwards agree with a row's own to float rounding, so only logits tied
that closely could pick another token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import torch

from meshyard.inference.checks import check_sequences
from meshyard.inference.decoding import (decode_step, device_of, prefill, prefill_groups, prefill_together,
                                         require_kv_cache)
from meshyard.inference.engine import Engine
from meshyard.inference.sampling import Sampling, generator_for, next_tokens
from meshyard.models.kv_cache import KVCache
from meshyard.serve.batching import SHUTTING_DOWN, ClientDisconnected, DisconnectCheck, call_hook, clients_gone
from meshyard.serve.inbox import Inbox
from meshyard.serve.types import BadRequest, DeadlineExceeded, QueueFull, ServeError, Unavailable

log = logging.getLogger(__name__)

GenerateItem = tuple[Sequence[int], Sampling]
OnStep = Callable[[int, float, int], None]
"""on_step(batch_size, seconds, new_tokens) after each step (for metrics)."""


@dataclass(eq=False)
class _Request:
    """One generate request from submission to its last token."""

    prompt: list[int]
    sampling: Sampling
    deadline: float
    is_disconnected: DisconnectCheck | None
    future: asyncio.Future
    submitted_at: float = field(default_factory=time.monotonic)
    slot: int | None = None
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    failure: Exception | None = None  # its prefill failed (only this request fails)
    updates: Inbox[list[int] | None] | None = None  # a streamed request's new tokens, then None at its end
    sent: int = 0  # how many of its tokens went into ``updates``

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.sampling.max_new_tokens


class ContinuousBatcher:
    """Runs generate requests for one engine whose module implements the KV-cache protocol
    (``meshyard.models.kv_cache``), joining and leaving the running batch between steps.

    ``submit`` has the signature of ``DynamicBatcher.submit`` with items (prompt tokens,
    Sampling) and results the new tokens. At most ``max_queue`` requests wait for a slot
    (more: QueueFull); a request's deadline is checked while it waits and between steps.
    ``on_step(batch_size, seconds, new_tokens)`` follows each step, ``on_queue_wait(seconds)``
    each admission (the time from ``submit`` to the step that prefilled it), both on the
    event loop (for metrics; a failing hook is logged and ignored)."""

    def __init__(self, engine: Engine, *, max_batch_size: int, max_queue: int, executor: Executor,
                 on_step: OnStep | None = None, on_queue_wait: Callable[[float], None] | None = None) -> None:
        module = getattr(engine, "module", None)
        if module is None:
            raise TypeError(f"{type(engine).__name__} exposes no PyTorch module: continuous batching needs an "
                            "eager engine whose model has a KV cache; use serve.scheduler = 'dynamic'")
        require_kv_cache(module)
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size={max_batch_size} and max_queue={max_queue}: a batch needs at "
                             "least one slot and the queue cannot be negative")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._executor = executor
        self._on_step = on_step
        self._on_queue_wait = on_queue_wait
        self._last_step_s = 0.0  # for the Retry-After estimate
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._cache: KVCache | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._prefill_fell_back = False  # a prefill together failed (warned once)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    async def submit(self, item: GenerateItem, deadline: float,
                     is_disconnected: DisconnectCheck | None = None) -> list[int]:
        """The new tokens for ``item`` = (prompt tokens, Sampling), exactly ``max_new_tokens`` of
        them. Raises BadRequest for a prompt the model cannot take, QueueFull when
        ``max_queue`` requests already wait, DeadlineExceeded when ``deadline``
        (``time.monotonic()``) passes first, ClientDisconnected when ``is_disconnected`` says
        so, Unavailable when its generation failed or the batcher closed."""
        request = self._enqueue(item, deadline, is_disconnected)
        if request.done:
            return []
        try:
            return await asyncio.wait_for(asyncio.shield(request.future), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            # Answered in the same instant the wait ran out: the answer counts.
            self._abandon(request, self._expired(request))
            return request.future.result()
        except asyncio.CancelledError:
            self._abandon(request, ClientDisconnected("the caller stopped waiting"))
            raise

    async def stream(self, item: GenerateItem, deadline: float,
                     is_disconnected: DisconnectCheck | None = None) -> AsyncIterator[list[list[int]]]:
        """The new tokens of ``item`` as the steps make them: at each wake, the steps made since
        the last (a list of token lists, one per step: two tokens from the step that prefills it,
        one from each step after), refused and failed as ``submit``. Closing the iterator early
        (with ``contextlib.aclosing``) abandons the request: its slot is free at the next step."""
        request = self._enqueue(item, deadline, is_disconnected, streamed=True)
        if request.done:  # nothing to generate: never queued
            return
        updates = request.updates
        # One timer for the whole stream (not one per step): past the deadline the request is
        # abandoned and its reader woken.
        expiry = asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), self._expire, request)
        try:
            while True:
                steps = await updates.take()
                if None in steps:  # answered, failed, expired or shut down
                    steps = steps[: steps.index(None)]
                    if steps:
                        yield steps
                    break
                yield steps
            error = request.future.exception()
            if error is not None:
                raise error
        finally:
            expiry.cancel()
            self._abandon(request, ClientDisconnected("the caller stopped reading its stream"))

    async def close(self) -> None:
        """Fail what waits or runs with Unavailable and stop the background task."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request in [*self._waiting, *self._running]:
            self._resolve(request, error=Unavailable(SHUTTING_DOWN))

    # -- submission ---------------------------------------------------------------------

    def _enqueue(self, item: GenerateItem, deadline: float,
                 is_disconnected: DisconnectCheck | None, streamed: bool = False) -> _Request:
        """Validate, refuse when full or late, queue, and make sure the loop runs."""
        prompt, sampling = list(item[0]), item[1]
        try:
            check_sequences([prompt], self.engine.vocab_size, self.engine.context_length, [sampling.max_new_tokens])
        except ValueError as error:
            raise BadRequest(str(error)) from None
        if self._closed:
            raise Unavailable(SHUTTING_DOWN)
        # Requests that free slots will take at the next step boundary do not count as queued.
        queued = len(self._waiting) - (self.max_batch_size - len(self._running))
        if queued >= self.max_queue:
            raise QueueFull(f"{queued} generate requests already wait for one of the {self.max_batch_size} "
                            f"running slots (serve.max_queue = {self.max_queue}): retry after the Retry-After "
                            "delay, or add replicas", retry_after_s=self._retry_after_s())
        future = asyncio.get_running_loop().create_future()
        request = _Request(prompt, sampling, deadline, is_disconnected, future,
                           updates=Inbox() if streamed else None)
        if time.monotonic() >= deadline:
            raise self._expired(request)
        if request.done:  # nothing to generate: no slot needed
            return request
        self._waiting.append(request)
        if self._task is None:
            self._task = asyncio.create_task(self._loop())
        return request

    def _retry_after_s(self) -> int:
        """Whole seconds until a slot is likely free for a request queued now: the tokens still
        owed to running and waiting requests, spread over the slots, at the last step's pace."""
        owed = sum(r.sampling.max_new_tokens - len(r.tokens) for r in [*self._running, *self._waiting])
        return max(1, math.ceil(owed / self.max_batch_size * self._last_step_s))

    @staticmethod
    def _expired(request: _Request) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the request was not answered before its deadline ({len(request.tokens)} of "
            f"{request.sampling.max_new_tokens} tokens ready): ask for fewer tokens or a longer timeout_ms")

    def _expire(self, request: _Request) -> None:
        """A stream's deadline passed: the request is abandoned and its reader gets its end."""
        self._abandon(request, self._expired(request))
        request.updates.put(None)

    def _abandon(self, request: _Request, error: ServeError) -> None:
        """The caller stopped waiting: the loop drops the request before its next step."""
        if not request.future.done():
            request.future.set_exception(error)
        request.future.exception()  # retrieved, so asyncio does not log it as never read

    # -- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        """Steps while anything waits or runs; ends (and is restarted by submit) when idle."""
        while True:
            await self._drop_gone()
            if not (self._waiting or self._running):
                self._task = None  # no await between the check and this: submit sees None and restarts
                return
            try:
                await self._iterate()
            except Exception as error:  # noqa: BLE001 - a failed step fails its rows, never the server
                log.exception("a continuous-batching step failed")
                for request in [*self._running, *(self._waiting if self._cache is None else ())]:
                    self._resolve(request, error=Unavailable(f"generation failed: {error}"))

    async def _iterate(self) -> None:
        """Admit, run one step in the executor, answer what is complete or failed, report."""
        loop = asyncio.get_running_loop()
        if self._cache is None:
            self._cache = await loop.run_in_executor(self._executor, self._new_cache)
        admitted = self._admit()
        batch = len(self._running)
        started = time.monotonic()
        new_tokens = await loop.run_in_executor(self._executor, self._step, admitted)
        self._last_step_s = time.monotonic() - started
        for request in admitted:
            call_hook(self._on_queue_wait, max(0.0, started - request.submitted_at))
        for request in self._running:
            self._send(request)
        for request in [r for r in self._running if r.done or r.failure is not None]:
            if request.failure is not None:
                self._resolve(request, error=Unavailable(f"generation failed: {request.failure}"))
            else:
                self._resolve(request, result=list(request.tokens))
        call_hook(self._on_step, batch, self._last_step_s, new_tokens)

    def _new_cache(self) -> KVCache:
        module = self.engine.module
        return module.init_kv_cache(self.max_batch_size, self.engine.context_length, device=device_of(module))

    async def _drop_gone(self) -> None:
        """Remove requests whose caller is gone or whose deadline passed, freeing their slots
        (the clients are asked together, not one after another)."""
        # The readers the last step woke run first: one that stops reading (a stop string
        # met, a client gone) gives up its slot before the next step, not after it.
        await asyncio.sleep(0)
        requests = [*self._waiting, *self._running]
        gone = await clients_gone([r.is_disconnected for r in requests])
        now = time.monotonic()
        for request, disconnected in zip(requests, gone):
            if request.future.done():
                self._remove(request)
            elif now >= request.deadline:
                self._resolve(request, error=self._expired(request))
            elif disconnected:
                self._resolve(request, error=ClientDisconnected("the client disconnected before its completion "
                                                                "was ready"))

    def _admit(self) -> list[_Request]:
        """Move waiting requests into free slots, oldest first."""
        admitted = []
        while self._waiting and self._cache.free_slots and len(self._running) < self.max_batch_size:
            request = self._waiting.popleft()
            request.slot = self._cache.allocate()
            self._running.append(request)
            admitted.append(request)
        return admitted

    def _step(self, admitted: list[_Request]) -> int:
        """In the executor: prefill the admitted requests (their first token), then one
        decoding forward for every running row that needs more. Returns the new tokens."""
        module, cache = self.engine.module, self._cache
        with torch.inference_mode():
            prefilled = self._prefill(admitted)
            rows = [r for r in self._running if r.tokens and not r.done]
            if rows:
                self._choose(rows, decode_step(module, cache, [r.slot for r in rows], [r.tokens[-1] for r in rows]))
        return prefilled + len(rows)

    def _prefill(self, admitted: list[_Request]) -> int:
        """Each admitted prompt into its slot and its first token, the prompts of one length
        together (``prefill_groups``: 16 prompts of 32 tokens prefilled one by one cost a small
        model most of a step's time); a prompt whose forward fails marks only its own request
        failed."""
        ready, logits = [], []
        for group in prefill_groups([len(request.prompt) for request in admitted]):
            for request, after in self._prefill_group([admitted[i] for i in group]):
                request.generator = generator_for(request.sampling)
                ready.append(request)
                logits.append(after)
        if ready:
            self._choose(ready, torch.stack(logits))
        return len(ready)

    def _prefill_group(self, group: list[_Request]) -> list[tuple[_Request, torch.Tensor]]:
        """``group``'s prompts (of one length) prefilled, with the logits after each; when the
        forward fails, each prompt again alone, so that only a failing one's request fails
        (answered as Unavailable by _iterate)."""
        module, cache = self.engine.module, self._cache
        if len(group) > 1:
            try:
                together = prefill_together(module, cache, [r.slot for r in group], [r.prompt for r in group])
                return list(zip(group, together))
            except Exception:  # noqa: BLE001 - which prompt failed is found one by one
                # Said once: a forward that always fails together (out of memory) would
                # otherwise make every step prefill one prompt at a time unseen.
                log.log(logging.DEBUG if self._prefill_fell_back else logging.WARNING,
                        "a prefill of %d prompts together failed; prefilling them one at a time (said once, "
                        "then at debug level)", len(group), exc_info=True)
                self._prefill_fell_back = True
        done = []
        for request in group:
            try:
                done.append((request, prefill(module, cache, request.slot, request.prompt)))
            except Exception as error:  # noqa: BLE001
                log.exception("the prefill of a %d-token prompt failed", len(request.prompt))
                request.failure = error
        return done

    def _choose(self, rows: list[_Request], logits: torch.Tensor) -> None:
        """Each row's next token from its logits row, with its own sampling and generator
        (never an id of a padded vocabulary's padding)."""
        chosen = next_tokens(logits, [r.sampling for r in rows], [r.generator for r in rows], self.engine.vocab_size)
        for request, token in zip(rows, chosen.tolist()):
            request.tokens.append(token)

    @staticmethod
    def _send(request: _Request) -> None:
        """A streamed request's tokens that its reader has not had yet."""
        if request.updates is not None and request.sent < len(request.tokens):
            request.updates.put(request.tokens[request.sent:])
            request.sent = len(request.tokens)

    def _resolve(self, request: _Request, *, result: list[int] | None = None,
                 error: ServeError | None = None) -> None:
        """Answer the caller (unless it already left) and free the request's place; a stream's
        reader gets its end."""
        if not request.future.done():
            if error is None:
                request.future.set_result(result)
            else:
                self._abandon(request, error)
        if request.updates is not None:
            self._send(request)
            request.updates.put(None)
        self._remove(request)

    def _remove(self, request: _Request) -> None:
        """Take ``request`` out of the queue or the batch; its slot becomes free."""
        if request in self._waiting:
            self._waiting.remove(request)
        if request in self._running:
            self._running.remove(request)
        if request.slot is not None and self._cache is not None:
            self._cache.release(request.slot)
            request.slot = None

