"""Serialise a ``Config`` to plain values and to commented TOML.

What is written down (config.toml, manifests, ``config show``) never holds credentials:
entries of fields marked ``secret_entries`` whose names look like credentials are
replaced by ``REDACTED``. ``config_to_dict`` keeps every value: it is what workers run with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

import tomli_w

from meshyard.config.sections import Config


REDACTED = "<redacted>"
# Option names of fsspec backends that carry credentials: s3fs key/secret/token, botocore's
# aws_access_key_id/aws_secret_access_key/aws_session_token, gcsfs token, adlfs
# account_key/sas_token/connection_string/client_secret, HTTP Authorization headers,
# passwords of sftp/ftp/webdav.
_CREDENTIAL_NAME = re.compile(r"key|secret|token|passw|credential|auth|session|signature|connection_string", re.I)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Every value, credentials included (for running, never for recording)."""
    return dataclasses.asdict(config)


def recorded_dict(config: Config) -> dict[str, dict[str, Any]]:
    """``config_to_dict`` with credentials redacted: the values that may be written down."""
    values = config_to_dict(config)
    for section_field in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section_field.name)):
            if f.metadata.get("secret_entries"):
                values[section_field.name][f.name] = redact(values[section_field.name][f.name])
    return values


def redact(value: Any) -> Any:
    """A copy of ``value`` whose credential-named entries (at any depth) read ``REDACTED``;
    booleans and empty values stay, as they hold no secret."""
    if isinstance(value, dict):
        return {key: REDACTED if _CREDENTIAL_NAME.search(str(key)) and _may_be_secret(item) else redact(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


def _may_be_secret(value: Any) -> bool:
    return not isinstance(value, bool) and value not in (None, "", {}, [])


def config_to_toml(config: Config, with_docs: bool = False) -> str:
    """TOML text of ``config``; with ``with_docs`` each key is preceded by its description."""
    values = recorded_dict(config)
    if not with_docs:
        return tomli_w.dumps(values)
    parts: list[str] = []
    for section_field in dataclasses.fields(config):
        section = getattr(config, section_field.name)
        doc = (type(section).__doc__ or "").strip()
        parts.append(f"# {doc}\n[{section_field.name}]")
        for f in dataclasses.fields(section):
            parts.append(f"# {f.metadata['doc']}\n{_toml_line(f.name, values[section_field.name][f.name])}")
        parts.append("")
    return "\n".join(parts)


def _toml_line(key: str, value: Any) -> str:
    """``key = value`` on one line; tables are written inline so they stay in their section."""
    if isinstance(value, dict):
        items = ", ".join(_toml_line(k, v) for k, v in value.items())
        return f"{key} = {{{' ' + items + ' ' if items else ''}}}"
    return tomli_w.dumps({key: value}).strip()


def config_hash(config: Config) -> str:
    """Stable short hash of the resolved values (identifies a configuration in records);
    credentials do not enter it, so it stays the same when they change or are redacted."""
    blob = json.dumps(recorded_dict(config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
