"""Serialise a ``Config`` to plain values and to commented TOML."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import tomli_w

from meshyard.config.sections import Config


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


def config_to_toml(config: Config, with_docs: bool = False) -> str:
    """TOML text of ``config``; with ``with_docs`` each key is preceded by its description."""
    if not with_docs:
        return tomli_w.dumps(config_to_dict(config))
    parts: list[str] = []
    for section_field in dataclasses.fields(config):
        section = getattr(config, section_field.name)
        doc = (type(section).__doc__ or "").strip()
        parts.append(f"# {doc}\n[{section_field.name}]")
        for f in dataclasses.fields(section):
            parts.append(f"# {f.metadata['doc']}\n{_toml_line(f.name, getattr(section, f.name))}")
        parts.append("")
    return "\n".join(parts)


def _toml_line(key: str, value: Any) -> str:
    """``key = value`` on one line; tables are written inline so they stay in their section."""
    if isinstance(value, dict):
        items = ", ".join(_toml_line(k, v) for k, v in value.items())
        return f"{key} = {{{' ' + items + ' ' if items else ''}}}"
    return tomli_w.dumps({key: value}).strip()


def config_hash(config: Config) -> str:
    """Stable short hash of the resolved values (identifies a configuration in records)."""
    blob = json.dumps(config_to_dict(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
