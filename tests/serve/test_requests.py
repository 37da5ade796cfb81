"""Reading and checking requests: each refusal has its status and names the field, the
value and what is accepted."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from meshyard.config.sections import ServeConfig
from meshyard.inference.sampling import Sampling
from meshyard.inference.source import ModelSource
from meshyard.inference.tokenizer import ByteTokenizer
from meshyard.serve.requests import (GenerateCall, LogitsCall, check_content_type, parse_generate, parse_json,
                                     parse_logits, read_body, shown)
from meshyard.serve.types import BadRequest, ReadTimeout

TEXT_MODEL = ModelSource(path="runs/tiny", name="tiny", version="step-3.abcdef", vocab_size=256, context_length=64,
                         tokenizer=ByteTokenizer(), estimated_bytes=1000, config=None)
IDS_MODEL = ModelSource(path="runs/custom", name="custom", version="step-3.123456", vocab_size=97,
                        context_length=32, tokenizer=None, estimated_bytes=1000, config=None)
CFG = ServeConfig(max_new_tokens=40, request_timeout_s=2.0, max_queue=4)


def refusal(call, *args) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        call(*args)
    return info.value


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def body_of(content_length: str | None, *parts: bytes, limit: int = 10) -> bytes:
    return asyncio.run(read_body(content_length, _chunks(*parts), limit))


# -- body ----------------------------------------------------------------------------------

def test_a_body_within_the_limit_is_read_whole():
    assert body_of("10", b"01234", b"56789") == b"0123456789"
    assert body_of(None, b"abc") == b"abc"


def test_an_announced_length_over_the_limit_is_refused_before_reading():
    error = refusal(body_of, "11", b"never read")
    assert error.status == 413
    assert "11 bytes" in error.message and "serve.max_body_bytes" in error.message


def test_a_body_longer_than_announced_is_cut_off_while_reading():
    for announced in ("4", None):  # a client that lies about the length, and a chunked body
        error = refusal(body_of, announced, b"012345", b"6789", b"X")
        assert error.status == 413 and "longer than 10 bytes" in error.message


def test_a_content_length_that_is_no_number_is_malformed():
    error = refusal(body_of, "ten", b"")
    assert error.status == 400 and "Content-Length" in error.message


@pytest.mark.parametrize("body, fragment", [
    (b"", "no body"),
    (b"{\"prompt\": ", "not valid JSON"),
    (b"\xff\xfe\x00", "not valid JSON"),
    (b"[1, 2]", "a JSON array, not an object"),
    (b"\"text\"", "a JSON string, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),
])
def test_malformed_bodies_are_400_with_an_example(body, fragment):
    error = refusal(parse_json, body, '{"prompt": "Hello"}')
    assert error.status == 400
    assert fragment in error.message and '{"prompt": "Hello"}' in error.message


@pytest.mark.parametrize("body, fragment", [
    (b'{"temperature": NaN}', "NaN is not a JSON value"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON value"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"prompt": "a\\ud800"}', "without its pair"),
    (b'{"\\udc00": 1}', "without its pair"),
])
def test_what_json_cannot_carry_is_400(body, fragment):
    error = refusal(parse_json, body, '{"prompt": "Hello"}')
    assert error.status == 400 and fragment in error.message


def test_a_surrogate_pair_is_text():
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}', "{}") == {"prompt": "\U0001f600"}


@pytest.mark.parametrize("content_type", [None, "", "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json", "text/json"])
def test_json_and_no_content_type_are_read(content_type):
    check_content_type(content_type, "{}")


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_other_content_types_are_415(content_type):
    error = refusal(check_content_type, content_type, '{"prompt": "Hello"}')
    assert error.status == 415 and content_type in error.message and "application/json" in error.message


def test_a_body_that_stops_arriving_is_408():
    async def stalls() -> AsyncIterator[bytes]:
        yield b'{"prompt": '
        await asyncio.sleep(60)
        yield b'"late"}'

    with pytest.raises(ReadTimeout) as info:
        asyncio.run(read_body("19", stalls(), 100, timeout_s=0.05))
    assert info.value.status == 408 and "serve.read_timeout_s" in info.value.message
    assert "11 bytes came" in info.value.message


def test_a_value_nested_too_deep_to_show_is_named_not_shown():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert shown(deep) == "(a value nested too deeply to show)"


# -- generate -------------------------------------------------------------------------------

def test_a_text_prompt_becomes_its_bytes_with_the_defaults():
    call = parse_generate(parse_json(b'{"prompt": "Hi \xc3\xa9"}', ""), TEXT_MODEL, CFG)
    assert call == GenerateCall(tokens=[72, 105, 32, 195, 169], sampling=Sampling(max_new_tokens=16), timeout_s=2.0)


def test_every_sampling_field_is_read():
    payload = {"tokens": [1, 2, 3], "max_new_tokens": 40, "temperature": 0.7, "top_k": 5, "seed": 9,
               "timeout_ms": 250}
    call = parse_generate(payload, TEXT_MODEL, CFG)
    assert call.tokens == [1, 2, 3] and call.timeout_s == 0.25
    assert call.sampling == Sampling(max_new_tokens=40, temperature=0.7, top_k=5, seed=9)


def test_greedy_requests_share_a_cache_entry_whatever_their_top_k_and_seed():
    greedy = [parse_generate({"tokens": [1], "top_k": k, "seed": s}, TEXT_MODEL, CFG).cache_payload()
              for k, s in ((0, None), (5, 3))]
    sampled = [parse_generate({"tokens": [1], "temperature": 1.0, "seed": s}, TEXT_MODEL, CFG).cache_payload()
               for s in (1, 2)]
    assert greedy[0] == greedy[1]
    assert sampled[0] != sampled[1] and sampled[0]["seed"] == 1


@pytest.mark.parametrize("payload, fragments", [
    ({"prompt": "a", "temp": 1}, ['unknown field "temp"', "temperature", "timeout_ms"]),
    ({"prompt": "a", "tokens": [1]}, ["exactly one of", "both"]),
    ({"max_new_tokens": 3}, ["exactly one of", "neither"]),
    ({"prompt": ""}, ["prompt = \"\"", "non-empty string"]),
    ({"prompt": 42}, ["prompt = 42", "non-empty string"]),
    ({"tokens": []}, ["tokens = []", "non-empty array", "0 to 255"]),
    ({"tokens": "1 2"}, ["tokens = \"1 2\"", "array of token ids"]),
    ({"tokens": [1, 256]}, ["tokens[1] = 256", "0 to 255", "'tiny'"]),
    ({"tokens": [-1]}, ["tokens[0] = -1", "0 to 255"]),
    ({"tokens": [1.0]}, ["tokens[0] = 1.0", "whole numbers"]),
    ({"tokens": [True]}, ["tokens[0] = true"]),
    ({"tokens": [1], "max_new_tokens": 41}, ["max_new_tokens = 41", "from 1 to 40", "serve.max_new_tokens"]),
    ({"tokens": [1], "max_new_tokens": 0}, ["max_new_tokens = 0", "from 1 to 40"]),
    ({"tokens": [1], "max_new_tokens": 8.0}, ["max_new_tokens = 8.0", "whole number"]),
    ({"tokens": [1] * 30, "max_new_tokens": 40}, ["30 tokens", "70 in all", "context of model 'tiny' (64",
                                                  "at most 34 new tokens"]),
    ({"tokens": [1] * 64, "max_new_tokens": 1}, ["64 tokens", "shorten the prompt to at most 63"]),
    ({"tokens": [1], "temperature": -0.5}, ["temperature = -0.5", "0 (greedy)"]),
    ({"tokens": [1], "temperature": "hot"}, ["temperature = \"hot\"", "finite number"]),
    ({"tokens": [1], "temperature": float("nan")}, ["temperature = NaN", "finite number"]),
    ({"tokens": [1], "top_k": -1}, ["top_k = -1", "at least 0"]),
    ({"tokens": [1], "seed": -3}, ["seed = -3", "0 to 9223372036854775807"]),
    ({"tokens": [1], "seed": 2 ** 70}, ["seed = 1180591620717411303424"]),
    ({"tokens": [1], "timeout_ms": 2001}, ["timeout_ms = 2001", "at most 2000", "serve.request_timeout_s"]),
    ({"tokens": [1], "timeout_ms": 0}, ["timeout_ms = 0", "above 0"]),
    ({"tokens": [1], "timeout_ms": 10 ** 400}, ["timeout_ms = 1000", "finite number"]),
    ({"tokens": [1], "temperature": float("inf")}, ["temperature = Infinity", "finite number"]),
])
def test_invalid_generate_requests_are_422_naming_field_value_and_what_is_accepted(payload, fragments):
    error = refusal(parse_generate, payload, TEXT_MODEL, CFG)
    assert error.status == 422
    for fragment in fragments:
        assert fragment in error.message, error.message
    assert "\n" not in error.message


def test_a_model_without_a_tokenizer_asks_for_token_ids():
    error = refusal(parse_generate, {"prompt": "hello"}, IDS_MODEL, CFG)
    assert error.status == 422 and "'custom' takes token ids only" in error.message
    assert 'send "tokens" instead' in error.message
    assert parse_generate({"tokens": [96]}, IDS_MODEL, CFG).tokens == [96]


def test_a_long_value_is_shown_cut_short():
    error = refusal(parse_generate, {"prompt": 7, "unknown" * 1000: 1}, TEXT_MODEL, CFG)
    assert len(error.message) < 400 and "..." in error.message


# -- logits ---------------------------------------------------------------------------------

def test_logits_of_sequences_and_of_prompts():
    assert parse_logits({"sequences": [[1, 2], [3]]}, TEXT_MODEL, CFG) == \
        LogitsCall(sequences=[[1, 2], [3]], top_k=0, timeout_s=2.0)
    call = parse_logits({"prompts": ["ab", "c"], "top_k": 3, "timeout_ms": 100}, TEXT_MODEL, CFG)
    assert call == LogitsCall(sequences=[[97, 98], [99]], top_k=3, timeout_s=0.1)
    assert call.cache_payload() == {"sequences": [[97, 98], [99]], "top_k": 3}


def test_a_top_k_wider_than_the_vocabulary_returns_it_all_in_order():
    assert parse_logits({"sequences": [[1]], "top_k": 1000}, IDS_MODEL, CFG).top_k == 97


@pytest.mark.parametrize("payload, fragments", [
    ({"sequences": [[1]], "prompt": "a"}, ['unknown field "prompt"', "prompts"]),
    ({"sequences": [[1]], "prompts": ["a"]}, ["exactly one of", "both"]),
    ({}, ["exactly one of", "neither"]),
    ({"sequences": []}, ["sequences = []", "1 to 4", "serve.max_queue"]),
    ({"sequences": [[1]] * 5}, ["1 to 4", "serve.max_queue"]),
    ({"sequences": [1, 2]}, ["sequences[0] = 1", "non-empty array"]),
    ({"sequences": [[1], []]}, ["sequences[1] = []"]),
    ({"sequences": [[1], [300]]}, ["sequences[1][0] = 300", "0 to 255"]),
    ({"sequences": [[1] * 65]}, ["sequences[0] has 65 tokens", "context of model 'tiny' (64", "last 64"]),
    ({"prompts": "abc"}, ["prompts = \"abc\"", "strings"]),
    ({"prompts": ["a", ""]}, ["prompts[1] = \"\"", "non-empty string"]),
    ({"sequences": [[1]], "top_k": -2}, ["top_k = -2", "at least 0"]),
])
def test_invalid_logits_requests_are_422(payload, fragments):
    error = refusal(parse_logits, payload, TEXT_MODEL, CFG)
    assert error.status == 422
    for fragment in fragments:
        assert fragment in error.message, error.message


def test_text_prompts_to_a_model_without_a_tokenizer_ask_for_sequences():
    error = refusal(parse_logits, {"prompts": ["hi"]}, IDS_MODEL, CFG)
    assert error.status == 422 and 'send "sequences" instead' in error.message
