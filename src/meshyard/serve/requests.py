"""What a request asks for, read and checked before it reaches a model.

A body declared as something other than JSON is refused (415). The body is read against
``serve.max_body_bytes`` (the announced Content-Length first, then the bytes as they arrive,
so a client that lies about the length is still cut off: 413) and within
``serve.read_timeout_s`` (408), parsed as a JSON object (400 otherwise: also for NaN and
Infinity, which JSON has not, nesting too deep to read, bytes that are not UTF-8 and lone
surrogate escapes, which are not text) and checked field by field against the model it
goes to (422): unknown fields, wrong types, token ids outside the vocabulary, prompts that
with their new tokens would not fit the context, and limits of the server. Every message
is one paragraph naming the field, the value and what is accepted, so a client fixes its
request without reading the server's code. Nothing here touches a model or the network.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

from meshyard.config.load import did_you_mean
from meshyard.config.sections import ServeConfig
from meshyard.inference.sampling import Sampling
from meshyard.serve.types import BadRequest, ReadTimeout

if TYPE_CHECKING:
    from meshyard.inference.source import ModelSource

GENERATE_FIELDS = ("prompt", "tokens", "max_new_tokens", "temperature", "top_k", "seed", "timeout_ms")
"""Fields a generate request may carry."""
LOGITS_FIELDS = ("sequences", "prompts", "top_k", "timeout_ms")
"""Fields a logits request may carry."""
DEFAULT_NEW_TOKENS = Sampling().max_new_tokens
MAX_SEED = 2 ** 63 - 1
# Below this a temperature divides logits into overflow; above it sampling is uniform anyway.
TEMPERATURE_RANGE = (1e-6, 1e6)
SHOWN_CHARS = 60
"""How much of an offending value a message repeats (a prompt can be megabytes long)."""
JSON_MEDIA_TYPES = ("application/json", "text/json")
"""Content-Types read as JSON (besides any ``+json`` type); a request without one is read as JSON too."""
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""The start of a ``\\uD800``-``\\uDFFF`` escape: half of a UTF-16 pair (alone, it is no text)."""


@dataclass(frozen=True)
class GenerateCall:
    """A checked generate request: the prompt's ids, how to draw, and its time limit."""

    tokens: list[int]
    sampling: Sampling
    timeout_s: float

    def cache_payload(self) -> dict[str, Any]:
        """What decides the answer, for the prediction cache's key. A greedy request ignores
        top_k and seed, so they are left out and equal greedy requests share one entry."""
        s = self.sampling
        greedy = s.temperature == 0.0
        return {"tokens": self.tokens, "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                "top_k": 0 if greedy else s.top_k, "seed": None if greedy else s.seed}


@dataclass(frozen=True)
class LogitsCall:
    """A checked logits request: the sequences, how many top ids to return (0: the whole
    distribution) and its time limit."""

    sequences: list[list[int]]
    top_k: int
    timeout_s: float

    def cache_payload(self) -> dict[str, Any]:
        """What decides the answer, for the prediction cache's key."""
        return {"sequences": self.sequences, "top_k": self.top_k}


def bad(message: str, status: int = 422) -> BadRequest:
    """A ``BadRequest`` answered with ``status`` (400 malformed, 413 too large, 422 invalid)."""
    return BadRequest(message, status=status)


def shown(value: Any) -> str:
    """``value`` as JSON, cut to a readable length."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:  # a value nested almost as deep as the parser allows
        return "(a value nested too deeply to show)"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


async def read_payload(headers: Mapping[str, str], chunks: AsyncIterator[bytes], cfg: ServeConfig,
                       example: str) -> dict[str, Any]:
    """A request's JSON object: its Content-Type checked, its body read within the server's
    limits and parsed; every refusal names ``example``'s shape or the setting at fault."""
    check_content_type(headers.get("content-type"), example)
    body = await read_body(headers.get("content-length"), chunks, cfg.max_body_bytes, cfg.read_timeout_s)
    return parse_json(body, example)


def check_content_type(content_type: str | None, example: str) -> None:
    """415 for a body declared as something other than JSON (a form, plain text); a request
    without a Content-Type is read as JSON, as a plain ``curl -d`` or ``httpx content=`` sends."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in JSON_MEDIA_TYPES or media_type.endswith("+json") or not media_type:
        return
    raise bad(f"the body is declared as {shown(media_type)} (Content-Type), but the server reads JSON only; send "
              f"a JSON object such as {example} with Content-Type: application/json", 415)


async def read_body(content_length: str | None, chunks: AsyncIterator[bytes], limit: int,
                    timeout_s: float | None = None) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes:
    from the Content-Length header before reading, else while reading (a chunked body, or a
    client that announced less than it sends); and with 408 when it has not all arrived
    within ``timeout_s`` (a client that sends half a body and waits would hold its
    connection and handler for ever)."""
    fix = (f"the server takes at most {limit} bytes (serve.max_body_bytes); send fewer or shorter sequences "
           "in one request, or start the server with a larger --serve.max_body_bytes")
    if content_length is not None:
        try:
            announced = int(content_length)
        except ValueError:
            raise bad(f"the Content-Length header {shown(content_length)} is not a number of bytes; send the "
                      "body's length in bytes, or let the HTTP client set it", 400) from None
        if announced > limit:
            raise bad(f"the body has {announced} bytes, over the limit: {fix}", 413)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                body += chunk
                if len(body) > limit:
                    raise bad(f"the body is longer than {limit} bytes: {fix}", 413)
    except TimeoutError:
        raise ReadTimeout(f"the body did not arrive within {timeout_s:g} s (serve.read_timeout_s; {len(body)} bytes "
                          "came), so the server closes the connection; send the whole request at once, or ask the "
                          "operator for a longer serve.read_timeout_s") from None
    return bytes(body)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value; send numbers as finite decimals")


def parse_json(body: bytes, example: str) -> dict[str, Any]:
    """The body as a JSON object; 400 naming what is wrong and showing ``example``."""
    fix = f"send a JSON object such as {example} (Content-Type: application/json)"
    if not body.strip():
        raise bad(f"the request has no body; {fix}", 400)
    try:
        payload = json.loads(body, parse_constant=_no_constant)
        if SURROGATE_ESCAPE.search(body):  # rare: only then is the whole payload encoded again
            json.dumps(payload, ensure_ascii=False).encode()
    except RecursionError:
        raise bad(f"the body nests JSON too deeply to read; {fix}", 400) from None
    except UnicodeEncodeError:
        raise bad(f"the body holds a \\uD800-\\uDFFF escape without its pair, which is no text; send "
                  f"valid Unicode; {fix}", 400) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits alike
        raise bad(f"the body is not valid JSON ({exc}); {fix}", 400) from None
    if not isinstance(payload, dict):
        raise bad(f"the body is a JSON {_json_type(payload)}, not an object; {fix}", 400)
    return payload


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_fields(payload: dict[str, Any], accepted: tuple[str, ...], kind: str) -> None:
    for key in payload:
        if key not in accepted:
            raise bad(f"unknown field {shown(key)} in a {kind} request{did_you_mean(str(key), accepted)}; "
                      f"the accepted fields are {', '.join(accepted)}")


def _whole(payload: dict[str, Any], key: str, default: int, low: int, high: int | None, what: str) -> int:
    """An integer field within [low, high] (high None: no upper bound)."""
    value = payload.get(key, default)
    if value is None:
        return default
    in_range = isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value <= high)
    if not in_range:
        bound = f"at least {low}" if high is None else f"from {low} to {high}"
        raise bad(f"{key} = {shown(value)} is not accepted: it must be a whole number {bound} ({what})")
    return value


def _number(payload: dict[str, Any], key: str, default: float) -> float:
    value = payload.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise bad(f"{key} = {shown(value)} is not accepted: it must be a finite number")
    return float(value)


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (a whole number of hundreds of digits is not one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _timeout(payload: dict[str, Any], cfg: ServeConfig) -> float:
    """Seconds the request may take: timeout_ms when given, at most serve.request_timeout_s."""
    limit_ms = cfg.request_timeout_s * 1000.0
    value = _number(payload, "timeout_ms", limit_ms)
    if not 0 < value <= limit_ms:
        raise bad(f"timeout_ms = {shown(payload['timeout_ms'])} is not accepted: it must be above 0 and at most "
                  f"{limit_ms:g} (the server's serve.request_timeout_s); leave it out to use that limit")
    return value / 1000.0


def _ids(value: Any, field: str, source: ModelSource) -> list[int]:
    """A non-empty list of token ids in [0, vocab)."""
    if not isinstance(value, list) or not value:
        raise bad(f"{field} = {shown(value)} is not accepted: it must be a non-empty array of token ids "
                  f"(whole numbers from 0 to {source.vocab_size - 1})")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < source.vocab_size:
            raise bad(f"{field}[{i}] = {shown(token)} is not a token id of model '{source.name}': ids are whole "
                      f"numbers from 0 to {source.vocab_size - 1} (its vocabulary has {source.vocab_size})")
    return value


def _encoded(text: Any, field: str, source: ModelSource, ids_field: str) -> list[int]:
    """The ids of a text prompt, through the model's tokenizer."""
    if source.tokenizer is None:
        raise bad(f"model '{source.name}' takes token ids only (its training data has no text encoding the "
                  f"server knows), so it cannot read {field}; send \"{ids_field}\" instead")
    if not isinstance(text, str) or not text:
        raise bad(f"{field} = {shown(text)} is not accepted: it must be a non-empty string")
    return _ids(source.tokenizer.encode(text), field, source)


def _prompt_tokens(payload: dict[str, Any], source: ModelSource) -> list[int]:
    has_prompt, has_tokens = "prompt" in payload, "tokens" in payload
    if has_prompt == has_tokens:
        given = "both" if has_prompt else "neither"
        raise bad(f"a generate request needs exactly one of \"prompt\" (text) and \"tokens\" (ids); it has "
                  f"{given}: send {{\"prompt\": \"Hello\"}} or {{\"tokens\": [72, 101]}}")
    if has_prompt:
        return _encoded(payload["prompt"], "prompt", source, "tokens")
    return _ids(payload["tokens"], "tokens", source)


def _sampling(payload: dict[str, Any], cfg: ServeConfig) -> Sampling:
    new = _whole(payload, "max_new_tokens", min(DEFAULT_NEW_TOKENS, cfg.max_new_tokens), 1, cfg.max_new_tokens,
                 "the server's serve.max_new_tokens is the upper limit")
    temperature = _number(payload, "temperature", 0.0)
    low, high = TEMPERATURE_RANGE
    if temperature != 0.0 and not low <= temperature <= high:
        raise bad(f"temperature = {shown(payload['temperature'])} is not accepted: it must be 0 (greedy) or "
                  f"from {low:g} to {high:g}")
    top_k = _whole(payload, "top_k", 0, 0, None, "0 keeps the whole vocabulary")
    seed = payload.get("seed")
    if seed is not None:
        seed = _whole(payload, "seed", 0, 0, MAX_SEED, "it makes sampling repeatable")
    return Sampling(max_new_tokens=new, temperature=temperature, top_k=top_k, seed=seed)


def parse_generate(payload: dict[str, Any], source: ModelSource, cfg: ServeConfig) -> GenerateCall:
    """A generate request's JSON object, checked against ``source`` and the server's limits."""
    _check_fields(payload, GENERATE_FIELDS, "generate")
    tokens = _prompt_tokens(payload, source)
    sampling = _sampling(payload, cfg)
    total = len(tokens) + sampling.max_new_tokens
    if total > source.context_length:
        room = source.context_length - len(tokens)
        fix = (f"ask for at most {room} new tokens or shorten the prompt" if room > 0
               else f"shorten the prompt to at most {source.context_length - 1} tokens")
        raise bad(f"the prompt has {len(tokens)} tokens and max_new_tokens is {sampling.max_new_tokens}: {total} "
                  f"in all, over the context of model '{source.name}' ({source.context_length} tokens); {fix}")
    return GenerateCall(tokens=tokens, sampling=sampling, timeout_s=_timeout(payload, cfg))


def _sequences(payload: dict[str, Any], source: ModelSource, cfg: ServeConfig) -> list[list[int]]:
    has_seq, has_prompts = "sequences" in payload, "prompts" in payload
    if has_seq == has_prompts:
        given = "both" if has_seq else "neither"
        raise bad(f"a logits request needs exactly one of \"sequences\" (arrays of ids) and \"prompts\" (texts); "
                  f"it has {given}: send {{\"sequences\": [[72, 101]]}} or {{\"prompts\": [\"Hello\"]}}")
    field = "sequences" if has_seq else "prompts"
    items = payload[field]
    # Each sequence waits in the model's queue as one item, so a request cannot hold more.
    if not isinstance(items, list) or not 1 <= len(items) <= cfg.max_queue:
        raise bad(f"{field} = {shown(items)} is not accepted: it must be an array of 1 to {cfg.max_queue} "
                  f"{'arrays of token ids' if has_seq else 'strings'} (the server's serve.max_queue)")
    if has_seq:
        sequences = [_ids(item, f"sequences[{i}]", source) for i, item in enumerate(items)]
    else:
        sequences = [_encoded(item, f"prompts[{i}]", source, "sequences") for i, item in enumerate(items)]
    for i, sequence in enumerate(sequences):
        if len(sequence) > source.context_length:
            raise bad(f"{field}[{i}] has {len(sequence)} tokens, over the context of model '{source.name}' "
                      f"({source.context_length} tokens); keep only its last {source.context_length} tokens")
    return sequences


def parse_logits(payload: dict[str, Any], source: ModelSource, cfg: ServeConfig) -> LogitsCall:
    """A logits request's JSON object, checked against ``source`` and the server's limits."""
    _check_fields(payload, LOGITS_FIELDS, "logits")
    sequences = _sequences(payload, source, cfg)
    top_k = _whole(payload, "top_k", 0, 0, None, "0 or leaving it out returns every id's log-probability")
    return LogitsCall(sequences=sequences, top_k=min(top_k, source.vocab_size), timeout_s=_timeout(payload, cfg))
