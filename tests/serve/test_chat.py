"""``POST /v1/chat/completions``, asked through the official ``openai`` client.

One server runs for the module (continuous scheduler) with two models: ``hf``, a tiny
Hugging Face GPT-2 folder built here whose ``tokenizer_config.json`` carries a chat template
(a byte-level BPE with the template's role tokens), and ``tiny``, the trained byte-level run,
which has no template of its own and answers through ``--serve.chat_template``. A chat
answer is checked against the completion of the prompt its template makes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshyard.config.sections import ServeConfig
from meshyard.inference.chat_template import ChatTemplate
from meshyard.inference.source import ModelSource
from meshyard.serve.chat import _messages, chat_logprobs, template_for
from meshyard.serve.types import BadRequest
from tests.serve.servers import ServerProcess, running_servers

openai = pytest.importorskip("openai")
pytest.importorskip("jinja2")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HF_TEMPLATE = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
               "{{ raise_exception('this model takes system, user and assistant turns only') }}{% endif %}"
               "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SERVER_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: def "
CORPUS = ["def add(a, b):\n    return a + b\n", "Hello there, how are you today?", "The quick brown fox jumps."] * 4
EOT = "<|endoftext|>"
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def hf_prompt(messages: list[dict]) -> str:
    """What HF_TEMPLATE makes of ``messages`` (as the test reads it)."""
    return "".join(f"<|{m['role']}|>{m['content']}{EOT}" for m in messages) + "<|assistant|>"


def server_prompt(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: def "


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A random 1-layer GPT-2 with a 300-token byte-level BPE and a chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    import torch

    folder = tmp_path_factory.mktemp("chat") / "hf"
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT, "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(), n_positions=128, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": HF_TEMPLATE, "eos_token": EOT}))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, trained_run, chat_folder) -> ServerProcess:
    folder = tmp_path_factory.mktemp("chat-server")
    (folder / "chat.jinja").write_text(SERVER_TEMPLATE)
    args = [str(trained_run), f"hf={chat_folder}", "--pin", "tiny", "--pin", "hf", "--cache", "off",
            "--serve.scheduler=continuous", "--serve.max_batch_size=2", "--serve.max_queue=4",
            "--serve.max_new_tokens=40", "--serve.threads=1", f"--serve.chat_template={folder / 'chat.jinja'}"]
    with running_servers(folder, [args]) as started:
        yield started[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


@pytest.mark.parametrize("model,prompt_of", [("tiny", server_prompt), ("hf", hf_prompt)])
def test_a_chat_answer_is_the_completion_of_the_templates_prompt(client, model, prompt_of):
    expected = client.completions.create(model=model, prompt=prompt_of(HELLO), max_tokens=10, temperature=0)
    answer = client.chat.completions.create(model=model, messages=HELLO, max_completion_tokens=10, temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == model
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.choices[0].text
    assert choice.finish_reason == expected.choices[0].finish_reason
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    assert answer.usage.completion_tokens == expected.usage.completion_tokens
    if model == "tiny":  # the byte tokenizer: one token per byte of the rendered prompt
        assert answer.usage.prompt_tokens == len(server_prompt(HELLO).encode())


def test_a_streamed_chat_adds_up_to_the_answer_with_its_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert len(with_choices) > 2  # a chunk per decoding step
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    deltas = [chunk.choices[0].delta for chunk in with_choices]
    assert deltas[0].role == "assistant" and all(delta.role is None for delta in deltas[1:])
    assert "".join(delta.content or "" for delta in deltas) == whole.choices[0].message.content
    assert [chunk.choices[0].finish_reason for chunk in with_choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings_cut_chat_answers_streamed_or_not(client):
    short = [{"role": "user", "content": "Hi"}]  # tiny's context is 64 tokens
    full = client.chat.completions.create(model="tiny", messages=short, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    stop = text[6:9]
    cut = text[: text.find(stop)]
    answer = client.chat.completions.create(model="tiny", messages=short, max_tokens=24, temperature=0, stop=stop)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.chat.completions.create(model="tiny", messages=short, max_tokens=24, temperature=0,
                                                   stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_seed_text_parts_and_logprobs(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    answer = client.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0.8, seed=3,
                                            n=2, logprobs=True, top_logprobs=2)
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert answer.usage.prompt_tokens == len(server_prompt([{"role": "user", "content": "Hel\nlo"}]).encode())
    content = answer.choices[0].logprobs.content
    assert len(content) == 4 and all(entry.logprob <= 0 and len(entry.top_logprobs) <= 2 for entry in content)
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    again = client.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0.8, seed=3)
    assert again.choices[0].message.content == answer.choices[0].message.content


@pytest.mark.parametrize("messages,words", [
    ([], "must be a non-empty array of messages"),
    ("Hello", "must be a non-empty array of messages"),
    (["Hello"], "messages[0] = \"Hello\" is not a message"),
    ([{"content": "Hello"}], "messages[0].role = null is not accepted"),
    ([{"role": "robot", "content": "Hello"}], "messages[0].role = \"robot\" is not accepted"),
    ([{"role": "user", "content": 7}], "messages[0].content = 7 is not accepted"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text parts only"),
    ([{"role": "user", "content": "Hello", "mood": "happy"}], "unknown field \"mood\""),
])
def test_malformed_messages_are_400_error_objects(client, messages, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="hf", messages=messages)
    assert caught.value.status_code == 400 and words in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == "invalid_request"


def test_a_template_that_refuses_the_messages_and_bad_fields(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="hf", messages=[{"role": "tool", "content": "42", "tool_call_id": "a"}])
    assert "system, user and assistant turns only" in caught.value.message
    assert "tokenizer_config.json" in caught.value.message  # names the template's origin
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=41)
    assert "max_completion_tokens = 41 is not accepted" in caught.value.message
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, frequency_penalty=0.5)
    assert "unknown field \"frequency_penalty\"" in caught.value.message


def test_the_model_listing_is_unchanged(client):
    assert sorted(model.id for model in client.models.list().data) == ["hf", "tiny"]


# -- without a server ----------------------------------------------------------------------------

def _source(template: ChatTemplate | None) -> ModelSource:
    return ModelSource(path="p", name="m", version="v", vocab_size=256, context_length=64, tokenizer=None,
                       estimated_bytes=0, config=None, chat_template=template)


def test_the_servers_template_fills_in_or_overrides():
    own = ChatTemplate("own", "model", bos_token="<s>", eos_token="</s>")
    configured = ChatTemplate("server's", "chat.jinja")
    cfg = ServeConfig()
    assert template_for(_source(own), None, cfg) is own
    assert template_for(_source(None), None, cfg) is None
    assert template_for(_source(None), configured, cfg) is configured
    assert template_for(_source(own), configured, cfg) is own
    overriding = template_for(_source(own), configured, replace(cfg, chat_template_overrides=True))
    assert (overriding.text, overriding.bos_token, overriding.eos_token) == ("server's", "<s>", "</s>")


def test_messages_keep_tool_turns_and_join_text_parts():
    messages = _messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]},
                          {"role": "tool", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}],
                           "tool_call_id": "a"}])
    assert messages[0]["content"] is None and messages[1]["content"] == "4\n2"
    with pytest.raises(BadRequest, match="must be a string"):
        _messages([{"role": "user", "content": None}])


def test_completion_logprobs_in_chats_shape():
    part = {"tokens": ["a", "é"], "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{"a": -0.5}, {"é": -1.0, "b": -2.0}], "text_offset": [0, 1]}
    content = chat_logprobs(part)["content"]
    assert content[1] == {"token": "é", "logprob": -1.0, "bytes": [195, 169],
                          "top_logprobs": [{"token": "é", "logprob": -1.0, "bytes": [195, 169]},
                                           {"token": "b", "logprob": -2.0, "bytes": [98]}]}
