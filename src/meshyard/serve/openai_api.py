"""The OpenAI-compatible routes: ``POST /v1/completions`` (streamed as server-sent events on
request) and ``POST /v1/chat/completions`` (the OpenAI fields of ``GET /v1/models`` are in
``meshyard.serve.app``'s listing).

A completions request is checked (``meshyard.serve.completions``), its model chosen as a
generate request's is (the ``model`` field, and the ``X-Model-Version`` header), and each of
its choices (n per prompt) goes to the model's generate batcher as one request. Both
batchers give a choice's tokens at every decoding step: the continuous batcher by its own
loop, the dynamic batcher through its batch's ``generate`` call
(``meshyard.serve.dynamic_generate``), where a choice asks for its steps only when they
are read before the end (streamed, or a stop string may end it early); otherwise its tokens
come at once. Each choice's text goes through a ``TextStream``; a choice that meets a stop
string, or whose client left, stops reading its tokens, which frees its row (its slot in a
continuous batch, its row of a dynamic batch) at the next step. A chat request is the
completion of the prompt its messages make (``meshyard.serve.chat``), run the same way;
only the shape of its answer differs (``TextShape`` or ``ChatShape``). A
streamed request is answered once its first tokens are there, so a refusal before them
(full queue, deadline) still gets its status; a failure after them ends the stream with
an error event. Errors are OpenAI's error objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshyard.inference.engine import Engine
from meshyard.inference.sampling import Sampling
from meshyard.serve.app import disconnect_check, request_payload
from meshyard.serve.chat import ChatShape, parse_chat, template_for
from meshyard.serve.completions import CompletionCall, TextStream, parse_completion
from meshyard.serve.batching import DisconnectCheck
from meshyard.serve.dynamic_generate import DynamicGenerateItem, streamed
from meshyard.serve.event_stream import EventStream
from meshyard.serve.requests import bad, shown
from meshyard.serve.routing import VERSION_HEADER
from meshyard.serve.types import BadRequest, DeadlineExceeded, NotFound, QueueFull, ServeError

if TYPE_CHECKING:
    from meshyard.inference.source import ModelSource
    from meshyard.inference.tokenizer import Tokenizer
    from meshyard.serve.app import Exchange, Lane, Server

log = logging.getLogger("meshyard.serve")

COMPLETIONS_EXAMPLE = '{"model": "tiny", "prompt": "Hello", "max_tokens": 16}'
CHAT_EXAMPLE = '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}'
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error", 504: "timeout_error"}
LOWEST_LOGPROB = -1e30


def error_object(exc: ServeError) -> dict[str, Any]:
    """OpenAI's error object for ``exc``: its message, a type from its status, and a code."""
    codes = {NotFound: "model_not_found", QueueFull: "queue_full", DeadlineExceeded: "deadline_exceeded",
             BadRequest: "invalid_request"}
    code = next((name for kind, name in codes.items() if isinstance(exc, kind)), None)
    return {"error": {"message": exc.message, "type": ERROR_TYPES.get(exc.status, "server_error"),
                      "param": None, "code": code}}


def openai_error(exc: ServeError) -> JSONResponse:
    """``exc`` as OpenAI's error object, with its status (and Retry-After for a full queue)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
    return JSONResponse(error_object(exc), status_code=exc.status, headers=headers)


def _choose(server: Server, request: Request, exchange: Exchange, payload: dict[str, Any]) -> ModelSource:
    name = payload.get("model")
    if not isinstance(name, str) or not name:
        known = ", ".join(server.router.names())
        raise bad(f"model = {shown(name)} is not accepted: name the model to ask (this server serves: {known})",
                  400)
    source = server.router.choose(name, request.headers.get(VERSION_HEADER) or None)
    exchange.model, exchange.version = source.name, source.version
    return source


class TextShape:
    """OpenAI's text completion objects: choices (and chunks' choices) carry text."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, logprobs: dict[str, list[Any]] | None,
               finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, logprobs: dict[str, list[Any]] | None, finish: str | None,
                     first: bool) -> dict[str, Any]:
        return self.choice(index, text, logprobs, finish)


Shape = TextShape | ChatShape


@dataclass
class Event:
    """A choice's progress: the text it adds, how many tokens that took, its logprobs part,
    and its finish reason on its last event."""

    index: int
    text: str
    tokens: int
    finish: str | None = None
    logprobs: dict[str, list[Any]] | None = None


async def completions(server: Server, request: Request, exchange: Exchange) -> dict[str, Any] | Response:
    """``POST /v1/completions``: OpenAI's completion object, or its chunks as server-sent events."""
    payload = await request_payload(server, request, COMPLETIONS_EXAMPLE)
    source = _choose(server, request, exchange, payload)
    return await _answer(server, request, source, parse_completion(payload, source, server.cfg), TextShape())


async def chat_completions(server: Server, request: Request, exchange: Exchange) -> dict[str, Any] | Response:
    """``POST /v1/chat/completions``: the completion of the prompt the messages make, as
    OpenAI's chat completion object or its chunks as server-sent events."""
    payload = await request_payload(server, request, CHAT_EXAMPLE)
    source = _choose(server, request, exchange, payload)
    call = parse_chat(payload, source, template_for(source, server.chat_template, server.cfg), server.cfg)
    return await _answer(server, request, source, call, ChatShape())


async def _answer(server: Server, request: Request, source: ModelSource, call: CompletionCall,
                  shape: Shape) -> dict[str, Any] | Response:
    """Runs ``call``'s choices and answers in ``shape``: one object, or a stream."""
    deadline = time.monotonic() + call.timeout_s
    head = {"id": f"{shape.id_prefix}{uuid.uuid4().hex}", "object": shape.object, "created": int(time.time()),
            "model": source.name}
    events = _events(server, source, call, deadline, disconnect_check(request))
    if not call.stream:
        async with aclosing(events):
            return await _completion(head, call, shape, events)
    try:
        first = await anext(events)  # a refusal before the first tokens still gets its status
    except BaseException:
        await events.aclose()
        raise
    chunk_head = {**head, "object": shape.chunk_object}
    return EventStream(_sse(chunk_head, call, shape, first, events), headers={"Cache-Control": "no-cache"})


async def _completion(head: dict[str, Any], call: CompletionCall, shape: Shape,
                      events: AsyncIterator[list[Event]]) -> dict[str, Any]:
    """Every event of every choice, gathered into OpenAI's completion object."""
    texts = {index: "" for index, _, _ in call.choices()}
    logprobs: dict[int, dict[str, list[Any]] | None] = {index: None for index in texts}
    finishes: dict[int, str | None] = {index: None for index in texts}
    completion_tokens = 0
    async for event in _one_by_one(events):
        texts[event.index] += event.text
        completion_tokens += event.tokens
        if event.logprobs is not None:
            logprobs[event.index] = _joined(logprobs[event.index], event.logprobs)
        finishes[event.index] = event.finish or finishes[event.index]
    choices = [shape.choice(index, texts[index], logprobs[index], finishes[index]) for index in sorted(texts)]
    return {**head, "choices": choices, "usage": _usage(call, completion_tokens)}


def _joined(before: dict[str, list[Any]] | None, part: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return part if before is None else {key: before[key] + part[key] for key in before}


def _usage(call: CompletionCall, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(prompt) for prompt in call.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _one_by_one(events: AsyncIterator[list[Event]]) -> AsyncIterator[Event]:
    async for ready in events:
        for event in ready:
            yield event


async def _sse(head: dict[str, Any], call: CompletionCall, shape: Shape, first: list[Event],
               events: AsyncIterator[list[Event]]) -> AsyncIterator[str]:
    """The stream's server-sent events: a chunk per event, the usage chunk when asked for,
    then ``[DONE]``; a failure after the first chunk ends it with an error event. The chunks
    of the events that are ready together go out in one write (one send through the server
    and one read for the client, where the stream's steps came faster than it was written)."""
    completion_tokens = 0
    chunk = ChunkTemplate(head, call.include_usage)
    started: set[int] = set()  # the choices that had their first chunk
    async with aclosing(events):
        try:
            ready: list[Event] | None = first
            while ready is not None:
                chunks = []
                for event in ready:
                    completion_tokens += event.tokens
                    chunks.append(chunk.of(shape.chunk_choice(event.index, event.text, event.logprobs, event.finish,
                                                              event.index not in started)))
                    started.add(event.index)
                yield "".join(chunks)
                ready = await anext(events, None)
        except ServeError as exc:
            yield _data(error_object(exc))
            return
        except Exception:  # noqa: BLE001 - the stream ends with an error event, the server goes on
            log.exception("a streamed completion failed")
            yield _data(error_object(ServeError("the server failed while streaming this completion (an internal "
                                                "error, logged with its traceback); try again")))
            return
    if call.include_usage:
        yield _data({**head, "choices": [], "usage": _usage(call, completion_tokens)})
    yield "data: [DONE]\n\n"


class ChunkTemplate:
    """A stream's chunk event around one choice, its constant part (id, object, created, model
    and, when usage is asked for, ``"usage": null``) serialised once: the event equals
    ``_data({**head, "choices": [choice], ...})``, at the cost of the choice's own JSON."""

    def __init__(self, head: dict[str, Any], include_usage: bool) -> None:
        self.before = f"data: {json.dumps(head)[:-1]}, \"choices\": ["
        self.after = ("], \"usage\": null}\n\n" if include_usage else "]}\n\n")

    def of(self, choice: dict[str, Any]) -> str:
        return f"{self.before}{json.dumps(choice)}{self.after}"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _events(server: Server, source: ModelSource, call: CompletionCall, deadline: float,
                  is_disconnected: DisconnectCheck) -> AsyncIterator[list[Event]]:
    """The events of every choice as they come, in lists of those that are ready together; the
    first failure of any choice is raised (after the events before it) and stops the others.
    A lone choice is read in the request's own task (no hand-over per step); several run as
    a task each (``_merged``)."""
    async with server.models.use(source) as engine:
        if not engine.supports_generate:
            raise bad(f"model '{source.name}' gives next-token distributions only and cannot complete text; "
                      f"ask POST /v1/models/{source.name}/logits instead", 400)
        lane = server.lane(source, "generate", engine)
        choices = [_choice(server, lane, engine, source.tokenizer, call, choice, deadline, is_disconnected)
                   for choice in call.choices()]
        merged = choices[0] if len(choices) == 1 else _merged(choices)
        async with aclosing(merged):
            async for ready in merged:
                yield ready


async def _merged(choices: list[AsyncIterator[list[Event]]]) -> AsyncIterator[list[Event]]:
    """The events of several choices, each read in its own task, in lists of those that are
    ready together; the first failure is raised (after the events before it) and stops the
    others. Each choice ends with the event that carries its finish reason."""
    queue: asyncio.Queue[list[Event] | BaseException] = asyncio.Queue()

    async def read(choice: AsyncIterator[list[Event]]) -> None:
        try:
            async with aclosing(choice):
                async for ready in choice:
                    queue.put_nowait(ready)
        except Exception as exc:  # noqa: BLE001 - raised by _merged to the request
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(read(choice)) for choice in choices]
    try:
        going = len(tasks)
        while going:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            failure = next((item for item in items if isinstance(item, BaseException)), None)
            if failure is not None:
                items = items[: items.index(failure)]
            ready = [event for item in items for event in item]
            if ready:
                going -= sum(event.finish is not None for event in ready)
                yield ready
            if failure is not None:
                raise failure
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _choice(server: Server, lane: Lane, engine: Engine, tokenizer: Tokenizer, call: CompletionCall,
                  choice: tuple[int, list[int], Sampling], deadline: float,
                  is_disconnected: DisconnectCheck) -> AsyncIterator[list[Event]]:
    """One choice's events: its tokens through its TextStream, an event per step, in lists of
    the steps that were ready together; the last event carries its finish reason."""
    index, prompt, sampling = choice
    text = TextStream(tokenizer, call.stop)
    echo = call.texts[index // call.n] if call.echo else ""
    offset = len(echo)
    by_step = call.stream or bool(call.stop)
    async with aclosing(_tokens(lane, engine, prompt, sampling, deadline, is_disconnected, by_step)) as sources:
        async for steps in sources:
            ready = []
            for tokens in steps:
                context = prompt + text.tokens if call.logprobs is not None else []
                delta = text.add(tokens)
                if text.finish is None and len(text.tokens) >= sampling.max_new_tokens:
                    delta += text.end()  # which may still meet a stop string
                    text.finish = text.finish or "length"
                logprobs = None
                if call.logprobs is not None:
                    logprobs = await _logprobs(server, engine, tokenizer, context, tokens, call.logprobs, offset)
                    offset += sum(len(token) for token in logprobs["tokens"])
                ready.append(Event(index, echo + delta, len(tokens), text.finish, logprobs))
                echo = ""
                if text.finish is not None:
                    break
            if text.finish is not None:
                break  # leaving the source frees the choice's row at the next step
            yield ready
        else:
            rest = text.end()
            ready = [Event(index, echo + rest, 0, text.finish or "length")]
    yield ready


def _tokens(lane: Lane, engine: Engine, prompt: list[int], sampling: Sampling, deadline: float,
            is_disconnected: DisconnectCheck, by_step: bool) -> AsyncIterator[list[list[int]]]:
    """A choice's new tokens as lists of the steps that are ready together (a list of tokens
    each): at every step from a continuous batcher, and from a dynamic one when ``by_step``
    (each step then costs the event loop a wake-up, worth it only when the tokens are read as
    they come); else all at once, as one step, when the dynamic batch ends."""
    if lane.engine is not None:
        return lane.batcher.stream((prompt, sampling), deadline, is_disconnected)
    if by_step:
        return streamed(lambda feed: lane.batcher.submit(DynamicGenerateItem(engine, prompt, sampling, feed),
                                                         deadline, is_disconnected))
    return _answered_whole(lane, DynamicGenerateItem(engine, prompt, sampling), deadline, is_disconnected)


async def _answered_whole(lane: Lane, item: DynamicGenerateItem, deadline: float,
                          is_disconnected: DisconnectCheck) -> AsyncIterator[list[list[int]]]:
    yield [await lane.batcher.submit(item, deadline, is_disconnected)]


async def _logprobs(server: Server, engine: Engine, tokenizer: Tokenizer, context: list[int], tokens: list[int],
                    top: int, offset: int) -> dict[str, list[Any]]:
    """OpenAI's logprobs part for ``tokens`` that followed ``context``: one forward over the
    prefixes, in the inference thread (the model's own distribution, before temperature)."""
    def run() -> torch.Tensor:
        prefixes = [context + tokens[:i] for i in range(len(tokens))]
        logprobs = torch.log_softmax(engine.next_token_logits(prefixes), dim=-1)
        return torch.nan_to_num(logprobs, neginf=LOWEST_LOGPROB)  # JSON has no -inf

    rows = await asyncio.get_running_loop().run_in_executor(server.executor, run)
    strings = [tokenizer.decode([token]) for token in tokens]
    offsets, at = [], offset
    for string in strings:
        offsets.append(at)
        at += len(string)
    tops = []
    for row in rows:
        values, ids = torch.topk(row, top) if top else (row[:0], row[:0].long())
        tops.append({tokenizer.decode([int(i)]): float(v) for i, v in zip(ids.tolist(), values.tolist())})
    return {"tokens": strings, "token_logprobs": [float(rows[i, token]) for i, token in enumerate(tokens)],
            "top_logprobs": tops, "text_offset": offsets}
