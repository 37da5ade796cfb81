"""Build a ``Config`` from defaults, a TOML file and ``--section.field=value`` overrides.

Precedence is CLI > file > defaults. Every problem found on the way (unknown sections or
keys, wrong types, values outside their choices) is collected and raised together as
one ``ConfigError``, so a user fixes a config in one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from meshyard.config.sections import SECTIONS, Config
from meshyard.errors import BadInput


class ConfigError(BadInput, ValueError):
    """One or more problems with a configuration; ``problems`` lists each one."""

    def __init__(self, problems: Iterable[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = len(self.problems)
        super().__init__(
            f"invalid {source} ({count} problem{'s' if count != 1 else ''}):\n{lines}\n"
            "Fix the keys above in the TOML file or the --section.field=value overrides; "
            "'meshyard config show' prints every valid key with its documentation."
        )


def did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.field=value`` (leading dashes allowed) into its parts.

    The value is read as a TOML value when it parses as one (numbers, booleans, arrays,
    quoted strings) and taken as a bare string otherwise, so ``--model.name=gpt-mini``
    needs no quotes.
    """
    body = text.lstrip("-")
    key, sep, raw = body.partition("=")
    if not sep or "." not in key:
        raise ConfigError([f"override '{text}' is not of the form --section.field=value"], "override")
    section, _, name = key.partition(".")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, name, value


def group_override_tokens(tokens: Iterable[str]) -> tuple[list[str], list[str]]:
    """Join ``--section.field value`` pairs into ``--section.field=value``.

    Returns (overrides, other tokens). A bare ``--section.flag`` means ``true``.
    """
    tokens = list(tokens)
    overrides, others = [], []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        key = token[2:].split("=", 1)[0]
        if token.startswith("--") and "." in key:
            if "=" not in token:
                has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
                token = f"{token}={tokens[i + 1]}" if has_value else f"{token}=true"
                i += has_value
            overrides.append(token)
        else:
            others.append(token)
        i += 1
    return overrides, others


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file '{path}' does not exist"], "config file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"config file '{path}' cannot be read: {exc.strerror or exc}"], "config file") from None
    try:
        # Decoded here rather than by read_text(): TOML is UTF-8 by definition, whatever the locale.
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError([
            f"{path}, line {line}: byte 0x{data[exc.start]:02x} is not UTF-8; TOML files must be UTF-8, so "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"], "config file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path} is not valid TOML: {exc}"], "config file") from None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(str(a).lower() if isinstance(a, bool) else repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> tuple[Any, str | None]:
    """Check ``value`` against the annotation ``tp``; return (value, problem or None)."""
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value, None
        hint = did_you_mean(str(value), [str(c) for c in choices])
        return value, f"{where} = {value!r} is not {_type_name(tp)}{hint}"
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):  # --flag=True from a shell
            value = value.lower() == "true"
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):  # TOML spells them nan and inf; no field means either
            return value, f"{where} = {value!r} should be a finite number"
    elif tp is str:
        # A whole number where text is expected (nnodes = 2, a numeric job id given on a
        # command line) means its digits.
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        ok = isinstance(value, str)
    elif tp is list:
        ok = isinstance(value, list)
        if not ok and isinstance(value, str):  # a single path given on the command line
            value, ok = [value], True
    elif tp is dict:
        ok = isinstance(value, dict)
    else:  # pragma: no cover - every field type is listed above
        raise TypeError(f"unsupported config field type {tp!r}")
    problem = None if ok else f"{where} = {value!r} should be {_type_name(tp)}, not {type(value).__name__}"
    return value, problem


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


# Values of earlier versions that are skipped on load, leaving the field at its default:
# config.toml files recorded by earlier runs still load (and resume). ``data.tokenizer``
# could only be "byte" then, which is today's default "bytes".
RETIRED_KEYS: dict[str, Any] = {"data.tokenizer": "byte"}


def merge(config: Config, values: dict[str, Any], origin: str, problems: list[str]) -> None:
    """Write ``{section: {field: value}}`` into ``config``, appending problems found."""
    for section_name, table in values.items():
        if section_name not in SECTIONS:
            problems.append(f"unknown section [{section_name}] in {origin}{did_you_mean(section_name, SECTIONS)}")
            continue
        merge_section(getattr(config, section_name), section_name, table, origin, problems)


def merge_section(section: Any, section_name: str, table: Any, origin: str, problems: list[str]) -> None:
    """Write ``{field: value}`` into one section object, appending problems found."""
    if not isinstance(table, dict):
        problems.append(f"[{section_name}] in {origin} should be a table of keys, not {table!r}")
        return
    types = _field_types(type(section))
    for key, value in table.items():
        where = f"{section_name}.{key}"
        if where in RETIRED_KEYS and value == RETIRED_KEYS[where]:
            continue
        if key not in types:
            problems.append(f"unknown key '{where}' in {origin}{did_you_mean(key, types)}")
            continue
        value, problem = coerce(value, types[key], where)
        if problem:
            problems.append(f"{problem} (from {origin})")
        else:
            setattr(section, key, value)


def _override_tables(overrides: Iterable[str], problems: list[str]) -> dict[str, dict[str, Any]]:
    """``--section.field=value`` overrides as ``{section: {field: value}}``, appending problems found."""
    nested: dict[str, dict[str, Any]] = {}
    grouped, stray = group_override_tokens(overrides)
    problems.extend(f"'{token}' is not an override of the form --section.field=value" for token in stray)
    for text in grouped:
        try:
            section, name, value = parse_override(text)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        nested.setdefault(section, {})[name] = value
    return nested


def collect_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> tuple[Config, list[str]]:
    """Resolve defaults < TOML file < overrides; return the config and every problem met.

    A value with a problem is left at its previous value so later checks can go on.
    """
    config = Config()
    problems: list[str] = []
    if path is not None:
        try:
            merge(config, read_toml(path), str(path), problems)
        except ConfigError as exc:
            problems.extend(exc.problems)
    merge(config, _override_tables(overrides, problems), "command line", problems)
    return config, problems


def collect_section(section_name: str, path: str | Path | None = None,
                    overrides: Iterable[str] = ()) -> tuple[Any, list[str]]:
    """One section alone (an instance of ``SECTIONS[section_name]``): defaults < the file's
    ``[section_name]`` table < its ``--section_name.field`` overrides, and every problem met.

    The file's other sections are neither read nor checked; an override of another
    section is a problem, since nothing here would read it.
    """
    section = SECTIONS[section_name]()
    problems: list[str] = []
    if path is not None:
        try:
            table = read_toml(path).get(section_name, {})
        except ConfigError as exc:
            problems.extend(exc.problems)
        else:
            merge_section(section, section_name, table, str(path), problems)
    tables = _override_tables(overrides, problems)
    problems.extend(f"--{other}.{key} sets [{other}], but only [{section_name}] is read here"
                    for other, table in tables.items() if other != section_name for key in table)
    merge_section(section, section_name, tables.get(section_name, {}), "command line", problems)
    return section, problems


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Resolve defaults < TOML file < overrides into a ``Config`` checked field by field.

    The result depends on nothing but its inputs: ``run.nproc = 0`` stays 0 ("this
    machine's default"), which the launching process resolves
    (``meshyard.validate.with_local_nproc``). Checks of ranges and combinations are in
    ``meshyard.config.checks``, those that need the world size in ``meshyard.validate``.
    """
    config, problems = collect_config(path, overrides)
    if problems:
        raise ConfigError(problems)
    return config


def load_section(section_name: str, path: str | Path | None = None, overrides: Iterable[str] = ()) -> Any:
    """One section of a config alone (``collect_section``), checked field by field on
    load; every problem is raised together as one ``ConfigError``."""
    section, problems = collect_section(section_name, path, overrides)
    if problems:
        raise ConfigError(problems)
    return section


def config_from_dict(values: dict[str, Any]) -> Config:
    """Build a ``Config`` from nested plain values (the inverse of ``config_to_dict``)."""
    config = Config()
    problems: list[str] = []
    merge(config, values, "dictionary", problems)
    if problems:
        raise ConfigError(problems)
    return config
