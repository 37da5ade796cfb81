"""What an OpenAI-compatible chat request asks for, and how its answer is shaped.

A ``POST /v1/chat/completions`` request runs as a completion: ``parse_chat`` checks its
messages, turns them into one prompt with the model's chat template
(``meshyard.inference.chat_template``) and checks the other fields as a completions
request's (``meshyard.serve.completions.completion_call``); ``ChatShape`` turns the
completion's events into ``chat.completion`` objects and ``chat.completion.chunk``s.

Which template a model answers with is decided in ``template_for`` alone: its tokenizer's
own, else ``serve.chat_template`` (which replaces the own one too under
``serve.chat_template_overrides``); without either the request is refused with 400 naming
both ways to give one. The template's end-of-sequence token (``eos_token``) ends a chat
answer as a stop string does, since a chat model writes it where its turn ends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from meshyard.config.sections import ServeConfig
from meshyard.inference.chat_template import ChatTemplate, ChatTemplateError, template_file
from meshyard.run_dir import RunDir
from meshyard.serve.completions import CompletionCall, completion_call, flag, needs_tokenizer, stops, top_logprobs
from meshyard.serve.requests import _check_fields, bad, shown

if TYPE_CHECKING:
    from meshyard.inference.source import ModelSource

CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "logprobs", "top_logprobs", "stream", "stream_options", "user", "timeout_ms")
"""Fields a chat request may carry (``top_k`` and ``timeout_ms`` are meshyard's)."""
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
MESSAGE_EXAMPLE = '{"role": "user", "content": "Hello"}'
PART_SEPARATOR = "\n"  # between the text parts of one message's content


def configured_template(cfg: ServeConfig) -> ChatTemplate | None:
    """``serve.chat_template``'s file, read and compiled; None when it is not set."""
    return template_file(cfg.chat_template) if cfg.chat_template else None


def template_for(source: ModelSource, configured: ChatTemplate | None, cfg: ServeConfig) -> ChatTemplate | None:
    """The template ``source`` answers chat requests with: its own, unless the server's
    (``configured``) overrides it or it has none. An overriding template keeps the model's
    special tokens, which are the model's whatever writes them."""
    own = source.chat_template
    if configured is None or (own is not None and not cfg.chat_template_overrides):
        return own
    if own is None:
        return configured
    return replace(configured, bos_token=own.bos_token, eos_token=own.eos_token)


def parse_chat(payload: dict[str, Any], source: ModelSource, template: ChatTemplate | None,
               cfg: ServeConfig) -> CompletionCall:
    """A chat request's JSON object as the completion of its messages' prompt, checked
    against ``source``, its ``template`` and the server's limits."""
    _check_fields(payload, CHAT_FIELDS, "chat completions")
    needs_tokenizer(source, "chat completions")
    if template is None:
        raise bad(f"model '{source.name}' has no chat template (its tokenizer folder holds no {RunDir.CHAT_TEMPLATE} "
                  f"and its {RunDir.TOKENIZER_CONFIG} no \"chat_template\"), so the server cannot turn chat messages "
                  "into its prompt; start the server with --serve.chat_template=FILE (a Jinja template), add a "
                  f"\"chat_template\" to the model's {RunDir.TOKENIZER_CONFIG}, or send the text as \"prompt\" to "
                  "POST /v1/completions", 400)
    messages = _messages(payload.get("messages"))
    try:
        text = template.render(messages)
    except ChatTemplateError as exc:
        raise bad(str(exc), 400) from None
    assert source.tokenizer is not None  # needs_tokenizer came first
    prompt = source.tokenizer.encode(text)
    if not prompt:
        raise bad(f"the chat template of {template.origin} made an empty prompt of these messages; send messages "
                  "with content", 400)
    end = [template.eos_token] if template.eos_token else []
    return completion_call(payload, source, cfg, [prompt], ["the prompt of the messages"],
                           max_tokens_key=_max_tokens_key(payload), stop=stops(payload.get("stop")) + end,
                           logprobs=_logprobs(payload), echo=False)


def _max_tokens_key(payload: dict[str, Any]) -> str:
    """The field that limits the answer: max_completion_tokens (OpenAI's current name) or
    max_tokens (its older one); both are accepted when they agree."""
    newer, older = payload.get("max_completion_tokens"), payload.get("max_tokens")
    if newer is not None and older is not None and newer != older:
        raise bad(f"max_completion_tokens = {shown(newer)} and max_tokens = {shown(older)} disagree; send one of them")
    return "max_tokens" if newer is None and older is not None else "max_completion_tokens"


def _logprobs(payload: dict[str, Any]) -> int | None:
    """How many most likely tokens to list per position; None when logprobs is not true."""
    if flag(payload, "logprobs"):
        return top_logprobs(payload, "top_logprobs")
    if payload.get("top_logprobs") is not None:
        raise bad(f"top_logprobs = {shown(payload['top_logprobs'])} needs \"logprobs\": true; send both, or neither")
    return None


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad(f"messages = {shown(value)} is not accepted: it must be a non-empty array of messages such as "
                  f"[{MESSAGE_EXAMPLE}]", 400)
    return [_message(item, f"messages[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> dict[str, Any]:
    """One message as the template gets it: its content as one text."""
    if not isinstance(item, dict):
        raise bad(f"{where} = {shown(item)} is not a message: send an object such as {MESSAGE_EXAMPLE}", 400)
    unknown = [key for key in item if key not in MESSAGE_FIELDS]
    if unknown:
        raise bad(f"{where} has the unknown field {shown(unknown[0])}; a message takes {', '.join(MESSAGE_FIELDS)}",
                  400)
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role = {shown(role)} is not accepted: it must be one of {', '.join(ROLES)}", 400)
    for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list)):
        if item.get(key) is not None and not isinstance(item[key], kind):
            raise bad(f"{where}.{key} = {shown(item[key])} is not accepted: it must be a "
                      f"{'string' if kind is str else 'list'}", 400)
    if item.get("content") is None and role == "assistant" and item.get("tool_calls"):
        return dict(item)  # an assistant turn that only called tools
    return {**item, "content": _content(item.get("content"), f"{where}.content")}


def _content(value: Any, where: str) -> str:
    """A message's content: a text, or a list of text parts ({"type": "text", "text": ...})
    joined with a newline."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}[{i}] = {shown(part)} is not accepted: this server reads text parts only, "
                          "{\"type\": \"text\", \"text\": \"...\"}", 400)
        return PART_SEPARATOR.join(part["text"] for part in value)
    raise bad(f"{where} = {shown(value)} is not accepted: it must be a string or a non-empty list of text parts "
              "({\"type\": \"text\", \"text\": \"...\"})", 400)


class ChatShape:
    """OpenAI's chat objects of a completion: a ``chat.completion`` whose choices carry a
    message, or ``chat.completion.chunk``s whose choices carry a delta (the first of each
    choice with the role, the others with content only)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, text: str, logprobs: dict[str, list[Any]] | None,
               finish: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(logprobs), "finish_reason": finish}

    def chunk_choice(self, index: int, text: str, logprobs: dict[str, list[Any]] | None, finish: str | None,
                     first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}


def chat_logprobs(part: dict[str, list[Any]] | None) -> dict[str, list[Any]] | None:
    """A completion's logprobs part (tokens, token_logprobs, top_logprobs) as chat's
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if part is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in top.items()]}
                        for token, logprob, top in zip(part["tokens"], part["token_logprobs"],
                                                       part["top_logprobs"])]}
