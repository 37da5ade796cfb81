"""How chat messages become a model's prompt: a Jinja chat template, as Hugging Face
tokenizers carry one.

A folder's own template (a Hugging Face model folder, or a run directory, which is itself
a tokenizer folder) is ``chat_template.jinja`` beside its tokenizer, else the
``chat_template`` of its ``tokenizer_config.json``: a string, or a list of named templates
of which the one named "default" is taken. ``tokenizer_config.json`` also gives the
``bos_token`` and ``eos_token`` a template may write.

A template renders in jinja2's immutable sandbox, with what published templates expect:
``messages``, ``add_generation_prompt`` (true: the prompt ends where the assistant's answer
begins), ``bos_token``, ``eos_token``, ``raise_exception(message)``, ``strftime_now(format)``,
a ``tojson`` that keeps non-ASCII text as it is, loop controls and ``{% generation %}``
blocks. The sandbox keeps a template from reaching the server's objects.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from meshyard.errors import BadInput
from meshyard.extras import require
from meshyard.run_dir import RunDir

DEFAULT_TEMPLATE_NAME = "default"  # of a list of named templates in tokenizer_config.json


class ChatTemplateError(BadInput, ValueError):
    """A template that cannot be read or compiled, or that refused to render the messages
    it was given; the message names the template's origin and what to do."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, where it was read (named in errors) and the special tokens
    its variables ``bos_token`` and ``eos_token`` stand for."""

    text: str
    origin: str
    bos_token: str = ""
    eos_token: str = ""

    def check(self) -> None:
        """Compiles the template, so a broken one is found before any request needs it."""
        _compiled(self.text, self.origin)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt of ``messages``, ending where the assistant's answer begins. A template
        that refuses them (``raise_exception``, or any failure inside it) raises
        ``ChatTemplateError`` with the template's own words."""
        template = _compiled(self.text, self.origin)
        try:
            return template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                   eos_token=self.eos_token)
        except Exception as exc:  # noqa: BLE001 - anything a template does wrong is the template's answer
            raise ChatTemplateError(f"the chat template of {self.origin} could not turn these messages into a "
                                    f"prompt ({_reason(exc)}); change the messages to what the template accepts "
                                    "(roles, their order, content as text)") from None


def read_chat_template(folder: Path) -> ChatTemplate | None:
    """The template ``folder`` holds (see the module docstring), with the special tokens of
    its ``tokenizer_config.json``; None when it holds none."""
    config_file = folder / RunDir.TOKENIZER_CONFIG
    config = _json_object(config_file) if config_file.is_file() else {}
    tokens = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
    jinja_file = folder / RunDir.CHAT_TEMPLATE
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), str(jinja_file), **tokens)
    text = _named_template(config.get("chat_template"), config_file)
    return ChatTemplate(text, str(config_file), **tokens) if text else None


def template_file(path: str) -> ChatTemplate:
    """The Jinja template in the file ``path``, compiled (no special tokens of its own)."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"the chat template file {path} cannot be read ({exc}); give the path of a Jinja "
                                "file that turns \"messages\" into a prompt") from None
    template = ChatTemplate(text, str(file))
    template.check()
    return template


def _json_object(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{file} cannot be read as JSON ({exc}); fix or remove it") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an object with its
    text under "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _named_template(value: Any, origin: Path) -> str | None:
    """The template of a "chat_template" value: the string itself, or from a list of
    {"name", "template"} objects the one named "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get(DEFAULT_TEMPLATE_NAME)
        if isinstance(chosen, str):
            return chosen
    raise ChatTemplateError(f"the \"chat_template\" of {origin} is neither a template nor a list of named "
                            f"templates with one named \"{DEFAULT_TEMPLATE_NAME}\"; fix it, or give the server a "
                            "template of its own (serve.chat_template with serve.chat_template_overrides = true)")


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


@functools.lru_cache(maxsize=32)
def _compiled(text: str, origin: str) -> Any:
    """The compiled template (compiled once per text: every request of a model renders it)."""
    jinja2 = require("jinja2", "a chat template (POST /v1/chat/completions)")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, _generation_block()])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(text)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template of {origin} is not a valid Jinja template ({_reason(exc)}); "
                                "fix it, or give the server another one (serve.chat_template)") from None


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt's text.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


@functools.cache
def _generation_block() -> type:
    """The ``{% generation %}...{% endgeneration %}`` tag, which marks the assistant's part
    of a prompt for training masks; rendering keeps its body as it is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationBlock
