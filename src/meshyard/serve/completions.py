"""What an OpenAI-compatible completions request asks for, and the text of its completions.

``parse_completion`` checks a ``POST /v1/completions`` body as ``meshyard.serve.requests``
checks a generate body (one paragraph per problem: 400 malformed, 413 too large, 422
invalid; nothing reaches a model). ``completion_call`` checks what every completion
request shares (n, sampling, the context, stop strings, streaming), so a chat request
(``meshyard.serve.chat``), once its messages are a prompt, runs as a completion.
``TextStream`` turns a completion's tokens, as they come, into the text a client may
already see: text that could still become a stop string, or a character whose bytes are
not all there yet, is held back until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshyard.config.sections import ServeConfig
from meshyard.inference.sampling import Sampling
from meshyard.serve.requests import DEFAULT_NEW_TOKENS, _check_fields, _encoded, _ids, _number, _sampling, \
    _timeout, _whole, bad, shown
from meshyard.serve.types import BadRequest

if TYPE_CHECKING:
    from meshyard.inference.source import ModelSource
    from meshyard.inference.tokenizer import Tokenizer

COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                     "logprobs", "echo", "stream", "stream_options", "user", "timeout_ms")
"""Fields a completions request may carry (``top_k`` and ``timeout_ms`` are meshyard's)."""
MAX_STOPS = 4  # as OpenAI's API
MAX_LOGPROBS = 5  # as OpenAI's API
UNDECIDED = "\ufffd"  # what a tokenizer decodes an incomplete character to


@dataclass(frozen=True)
class CompletionCall:
    """A checked completions request: one prompt per entry of ``prompts`` (ids), ``n``
    completions of each, how to draw them and what to return."""

    prompts: list[list[int]]
    texts: list[str]  # each prompt as text (for echo)
    n: int
    sampling: Sampling
    stop: list[str]
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    timeout_s: float

    def choices(self) -> list[tuple[int, list[int], Sampling]]:
        """(index, prompt, sampling) of every choice, prompt-major as OpenAI numbers them; a
        seeded request's choices draw with seeds seed, seed + 1, ... so they differ."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                seed = None if self.sampling.seed is None else self.sampling.seed + j
                out.append((p * self.n + j, prompt, replace(self.sampling, seed=seed)))
        return out


def parse_completion(payload: dict[str, Any], source: ModelSource, cfg: ServeConfig) -> CompletionCall:
    """A completions request's JSON object, checked against ``source`` and the server's limits."""
    _check_fields(payload, COMPLETION_FIELDS, "completions")
    needs_tokenizer(source, "text completions")
    prompts = _prompts(payload.get("prompt"), source)
    return completion_call(payload, source, cfg, prompts, [f"prompt {i}" for i in range(len(prompts))],
                           max_tokens_key="max_tokens", stop=stops(payload.get("stop")), logprobs=_logprobs(payload),
                           echo=flag(payload, "echo"))


def needs_tokenizer(source: ModelSource, what: str) -> None:
    """Refuses (400) a text request for a model that takes and gives token ids only."""
    if source.tokenizer is None:
        raise bad(f"model '{source.name}' has no tokenizer (it takes and gives token ids only), so it cannot "
                  f"answer {what}; ask POST /v1/models/{source.name}/generate with \"tokens\"", 400)


def completion_call(payload: dict[str, Any], source: ModelSource, cfg: ServeConfig, prompts: list[list[int]],
                    names: list[str], *, max_tokens_key: str, stop: list[str], logprobs: int | None,
                    echo: bool) -> CompletionCall:
    """The fields every completion request shares (n, max tokens under ``max_tokens_key``,
    temperature, top_k, top_p, seed, stream, stream_options, timeout_ms), checked for
    ``prompts`` (called ``names`` in messages) against ``source`` and the server's limits."""
    n = _whole(payload, "n", 1, 1, cfg.max_queue, "completions per prompt; serve.max_queue is the upper limit")
    if len(prompts) * n > cfg.max_queue:
        raise bad(f"{len(prompts)} prompts with n = {n} make {len(prompts) * n} completions, over the server's "
                  f"serve.max_queue ({cfg.max_queue}); send fewer prompts or a smaller n")
    renamed = {"max_new_tokens": payload.get(max_tokens_key, min(DEFAULT_NEW_TOKENS, cfg.max_new_tokens)),
               **{key: payload[key] for key in ("temperature", "top_k", "seed") if key in payload}}
    try:
        sampling = _sampling(renamed, cfg)
    except BadRequest as exc:  # the messages name max_new_tokens: say the request's own field
        exc.message = exc.message.replace("max_new_tokens", max_tokens_key)
        raise
    top_p = _number(payload, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p = {shown(payload['top_p'])} is not accepted: it must be above 0 and at most 1")
    sampling = replace(sampling, top_p=top_p)
    for name, prompt in zip(names, prompts):
        if len(prompt) + sampling.max_new_tokens > source.context_length:
            room = source.context_length - len(prompt)
            fix = (f"ask for at most {room} tokens ({max_tokens_key}) or shorten the prompt" if room > 0
                   else f"shorten the prompt to at most {source.context_length - 1} tokens")
            raise bad(f"{name} has {len(prompt)} tokens and {max_tokens_key} is {sampling.max_new_tokens}, over the "
                      f"context of model '{source.name}' ({source.context_length} tokens); {fix}")
    stream_options = payload.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise bad(f"stream_options = {shown(stream_options)} is not accepted: the server takes "
                  "{\"include_usage\": true or false}")
    assert source.tokenizer is not None  # needs_tokenizer came first
    return CompletionCall(prompts=prompts, texts=[source.tokenizer.decode(p) for p in prompts], n=n,
                          sampling=sampling, stop=stop, logprobs=logprobs, echo=echo, stream=flag(payload, "stream"),
                          include_usage=bool(stream_options.get("include_usage")), timeout_s=_timeout(payload, cfg))


def _prompts(value: Any, source: ModelSource) -> list[list[int]]:
    """The prompt as OpenAI takes it: a text, a list of texts, a list of ids or a list of
    lists of ids; each becomes one prompt of ids."""
    if isinstance(value, str):
        return [_encoded(value, "prompt", source, "prompt (as token ids)")]
    if isinstance(value, list) and value and all(isinstance(item, int) and not isinstance(item, bool)
                                                 for item in value):
        return [_ids(value, "prompt", source)]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return [_encoded(item, f"prompt[{i}]", source, "prompt (as token ids)") for i, item in enumerate(value)]
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        return [_ids(item, f"prompt[{i}]", source) for i, item in enumerate(value)]
    raise bad(f"prompt = {shown(value)} is not accepted: send a text, a list of texts, a list of token ids or a "
              "list of lists of token ids (one completion per prompt)")


def stops(value: Any) -> list[str]:
    """The stop strings of a "stop" field: none, one string or a list of them."""
    if value is None:
        return []
    given = [value] if isinstance(value, str) else value
    if not isinstance(given, list) or len(given) > MAX_STOPS or not all(isinstance(s, str) and s for s in given):
        raise bad(f"stop = {shown(value)} is not accepted: it must be a non-empty string or a list of at most "
                  f"{MAX_STOPS} of them")
    return given


def _logprobs(payload: dict[str, Any]) -> int | None:
    if payload.get("logprobs") is None:
        return None
    return top_logprobs(payload, "logprobs")


def top_logprobs(payload: dict[str, Any], key: str) -> int:
    """How many most likely tokens to list per position, from ``payload[key]``."""
    return _whole(payload, key, 0, 0, MAX_LOGPROBS, "how many most likely tokens to list per position")


def flag(payload: dict[str, Any], key: str) -> bool:
    """A true-or-false field (absent or null: false)."""
    value = payload.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{key} = {shown(value)} is not accepted: it must be true or false")
    return value


class TextStream:
    """The text of one completion as its tokens come: ``add`` returns the text newly decided,
    ``finish`` says why the completion ended ("stop" at a stop string, None while it goes on).
    The text the deltas add up to is the completion's whole text, cut before its first stop
    string, however the tokens were split into steps.

    Each step decodes a window, not the whole completion (a completion of n tokens decoded
    whole at every step costs O(n^2)): the tokens committed at the step before serve as
    context for the new ones (a subword tokenizer renders a token's leading space, or merges
    bytes into one character, by what precedes it), and the new text is what decoding the
    window with the new tokens adds to decoding it without them. New text ending in an
    incomplete character is not committed until the tokens that complete it come, but what
    precedes that character is decided (and searched for stop strings) at once."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""  # the committed text: that of tokens[:_read], made of whole characters
        self.sent = ""  # the text given out so far
        self.finish: str | None = None
        self._context = 0  # tokens[_context:_read] are decoded again with the new ones
        self._read = 0
        self._searched = 0  # text[:_searched] holds no stop string

    def add(self, tokens: list[int]) -> str:
        """The text ``tokens`` decide, after those before."""
        self.tokens += tokens
        new = self._new_text()
        if new and not new.endswith(UNDECIDED):
            self.text += new
            self._context, self._read, new = self._read, len(self.tokens), ""
        return self._decide(self.text + new.rstrip(UNDECIDED), final=False)

    def end(self) -> str:
        """The text still held back once no token follows (a stop string in it ends it there)."""
        self.text += self._new_text()
        self._context = self._read = len(self.tokens)
        return self._decide(self.text, final=True)

    def _new_text(self) -> str:
        """What the tokens after ``_read`` add to the committed text."""
        before = self.tokenizer.decode(self.tokens[self._context:self._read])
        after = self.tokenizer.decode(self.tokens[self._context:])
        if not after.startswith(before):
            # The context decodes otherwise now (a byte-fallback decoder turns a whole broken
            # byte run into U+FFFD): the new tokens are decoded alone from here on.
            self._context = self._read
            return self.tokenizer.decode(self.tokens[self._read:])
        return after[len(before):]

    def _decide(self, text: str, *, final: bool) -> str:
        """Gives out ``text`` up to its first stop string (then the completion is finished),
        else all of it but an end that could start one (all of it when ``final``)."""
        cut = self._first_stop(text)
        if cut is not None:
            self.finish = "stop"
            return self._delta(text[:cut])
        return self._delta(text if final else text[: len(text) - self._held(text)])

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string starts in ``text``, searching what is new since the
        committed text was last searched (from a stop string's length before it, for one
        that began in the text searched before)."""
        cuts = [found for found in (text.find(stop, max(0, self._searched - len(stop) + 1)) for stop in self.stop)
                if found >= 0]
        self._searched = len(self.text)
        return min(cuts) if cuts else None

    def _held(self, text: str) -> int:
        """How many characters at the end of ``text`` could start a stop string."""
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def _delta(self, text: str) -> str:
        # Never taken back: a text that does not extend what was given out waits.
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
