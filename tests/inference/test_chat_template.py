"""Chat templates: where a folder's comes from, and rendering it in the sandbox."""

from __future__ import annotations

import json

import pytest

from meshyard.inference.chat_template import ChatTemplate, ChatTemplateError, read_chat_template, template_file

pytest.importorskip("jinja2")

ROLES_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
HELLO = [{"role": "user", "content": "Hello"}]


def test_a_tokenizer_config_gives_the_template_and_its_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": ROLES_TEMPLATE, "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}}))
    template = read_chat_template(tmp_path)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.origin == str(tmp_path / "tokenizer_config.json")
    assert template.render(HELLO) == "<s><|user|>Hello</s>\n<|assistant|>"


def test_named_templates_take_the_default_and_a_jinja_file_comes_first(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "tools"},
                                                    {"name": "default", "template": "plain"}]}))
    assert read_chat_template(tmp_path).render(HELLO) == "plain"
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert read_chat_template(tmp_path).render(HELLO) == "from the file"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "tools"}]}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="named \"default\""):
        read_chat_template(tmp_path)


def test_a_folder_without_a_template_has_none(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert read_chat_template(tmp_path) is None


def test_templates_refuse_in_their_own_words_and_stay_in_the_sandbox():
    strict = ChatTemplate("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
                          "{% endif %}{{ m.content | tojson }}{% endfor %}", "strict.jinja")
    assert strict.render([{"role": "user", "content": "héllo <b>"}]) == '"héllo <b>"'  # no HTML escapes
    with pytest.raises(ChatTemplateError, match=r"strict\.jinja could not .*\(no tools here\)"):
        strict.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}", "escape.jinja").render(HELLO)
    looping = ChatTemplate("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}"
                           "{% endfor %}", "loop.jinja")
    assert looping.render(HELLO * 2) == "Hello"


def test_a_template_file_is_read_and_compiled_at_once(tmp_path):
    with pytest.raises(ChatTemplateError, match="cannot be read"):
        template_file(str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        template_file(str(broken))
    good = tmp_path / "good.jinja"
    good.write_text(ROLES_TEMPLATE)
    assert template_file(str(good)).render(HELLO) == "<|user|>Hello\n<|assistant|>"
