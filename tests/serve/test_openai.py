"""The OpenAI-compatible API of ``meshyard serve``, asked through the official ``openai`` client.

Two servers run for the module, on the trained text model (pinned) and a user's model on
token ids: ``continuous`` and ``dynamic``, each streaming a completion at every decoding
step. Completions are short and greedy unless a test says otherwise.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from meshyard.serve.openai_api import ChunkTemplate

from tests.serve.servers import ServerProcess, running_servers

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def add("


@pytest.fixture(scope="module")
def servers(tmp_path_factory, trained_run, custom_model_run) -> list[ServerProcess]:
    common = [str(trained_run), f"custom={custom_model_run}", "--pin", "tiny", "--cache", "off",
              "--serve.max_batch_size=2", "--serve.max_queue=4", "--serve.max_new_tokens=62", "--serve.threads=1"]
    arg_lists = [[*common, "--serve.scheduler=continuous"], [*common, "--serve.scheduler=dynamic",
                                                             "--serve.max_wait_ms=5"]]
    with running_servers(tmp_path_factory.mktemp("openai"), arg_lists) as started:
        yield started


@pytest.fixture(scope="module")
def continuous(servers) -> ServerProcess:
    return servers[0]


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def generated_text(server: ServerProcess, max_new_tokens: int) -> str:
    """What meshyard's own generate route answers for PROMPT (greedy)."""
    reply = httpx.post(f"{server.url}/v1/models/tiny/generate", timeout=60.0,
                       json={"prompt": PROMPT, "max_new_tokens": max_new_tokens})
    assert reply.status_code == 200, server.explain(reply)
    return reply.json()["text"]


@pytest.mark.parametrize("which", [0, 1], ids=["continuous", "dynamic"])
def test_greedy_completions_streamed_or_not_are_the_generate_routes_text(servers, which):
    server = servers[which]
    client = client_of(server)
    expected = generated_text(server, 12)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.model == "tiny" and answer.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == [(0, expected, "length")]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (8, 12, 20)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # A chunk per step: the continuous step that prefills a prompt also decodes its second
    # token; a dynamic batch's prefill gives the first token, each decoding step one more.
    assert len([c for c in chunks if c.choices]) == (11 if which == 0 else 12)


@pytest.mark.parametrize("which", [0, 1], ids=["continuous", "dynamic"])
def test_stop_strings_end_a_choice_streamed_or_not(servers, which):
    server = servers[which]
    client = client_of(server)
    full = generated_text(server, 24)
    stop = full[6:9]  # three characters: three byte tokens, met over three steps
    cut = full[: full.find(stop)]
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                              stop=stop, stream=True))
    # Text once sent is never taken back: the stop string's first characters were held back.
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"
    assert len(streamed) > 1
    # Greedy and sampled alike: the streamed text is the text answered whole.
    sampled = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0.9, "seed": 11}
    whole = client.completions.create(**sampled).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(**sampled, stream=True)) == whole


def test_echo_n_and_prompts_as_token_ids(continuous):
    client = client_of(continuous)
    ids = list(PROMPT.encode())  # the byte tokenizer: ids are the UTF-8 bytes
    answer = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=4, temperature=0.8, seed=7,
                                       n=2, echo=True, logprobs=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(c.text.startswith(PROMPT) for c in answer.choices)
    assert answer.choices[0].text == answer.choices[2].text  # same prompt, same seed
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(value <= 0 for value in logprobs.token_logprobs) and all(len(t) <= 2 for t in logprobs.top_logprobs)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chunk_from_its_template_is_the_chunk_serialised_whole(include_usage):
    head = {"id": "cmpl-1f\"x", "object": "text_completion", "created": 1700000000, "model": "tiny \u00e9"}
    choice = {"text": "a \"quoted\"\nline \u00e9", "index": 3, "logprobs": None, "finish_reason": None}
    whole = {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    assert ChunkTemplate(head, include_usage).of(choice) == f"data: {json.dumps(whole)}\n\n"


def test_errors_come_as_openai_error_objects_with_their_status(continuous):
    client = client_of(continuous)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi")
    assert caught.value.status_code == 404 and "no model is served under the name 'nope'" in caught.value.message
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["type"] == "not_found_error"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=500)
    assert "max_tokens = 500 is not accepted" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="custom", prompt="hi")
    assert "has no tokenizer" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "has no chat template" in caught.value.message and "/v1/completions" in caught.value.message
    assert "--serve.chat_template" in caught.value.message and "tokenizer_config.json" in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.InternalServerError) as caught:  # the client's class for statuses from 500
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48, stream=True, extra_body={"timeout_ms": 1})
    assert caught.value.status_code == 504 and caught.value.body["type"] == "timeout_error"
    reply = httpx.post(f"{continuous.url}/v1/completions", content=b"{not json", timeout=30.0)
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    # today's routes keep today's shape
    reply = httpx.post(f"{continuous.url}/v1/models/nope/generate", json={"tokens": [1]}, timeout=30.0)
    assert reply.status_code == 404 and isinstance(reply.json()["error"], str)


def test_the_model_listing_serves_openai_clients_and_todays(continuous):
    listed = client_of(continuous).models.list()
    assert sorted(model.id for model in listed.data) == ["custom", "tiny"]
    assert all(model.object == "model" and model.owned_by == "meshyard" for model in listed.data)
    assert {m["name"] for m in httpx.get(f"{continuous.url}/v1/models", timeout=30.0).json()["models"]} \
        == {"custom", "tiny"}


def test_a_client_that_leaves_a_dynamic_stream_frees_its_row(servers):
    dynamic = servers[1]
    with httpx.stream("POST", f"{dynamic.url}/v1/completions", timeout=60.0,
                      json={"model": "tiny", "prompt": "a", "max_tokens": 62, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert next(reply.iter_lines()).startswith("data: {")
    # The row stops at the next step, its batch ends early and its answer is dropped without
    # an error; the server answers a full batch of new requests.
    client = client_of(dynamic)
    for _ in range(2):
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].finish_reason == "length"
    assert "Traceback" not in dynamic.log(), dynamic.explain()


def test_a_client_that_leaves_a_stream_frees_its_slot(continuous):
    def generated() -> float:
        return continuous.metric("meshyard_serve_generated_tokens_total", model="tiny")

    before = generated()
    with httpx.stream("POST", f"{continuous.url}/v1/completions", timeout=60.0,
                      json={"model": "tiny", "prompt": "a", "max_tokens": 62, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        first = next(reply.iter_lines())
        assert first.startswith("data: {")
    time.sleep(1.0)  # the remaining steps, had the request not left
    assert generated() - before < 62, continuous.explain()
    # the slots are free: a full batch of new requests is answered
    client = client_of(continuous)
    for _ in range(2):
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].finish_reason == "length"
