"""Seeded random mutations of the shipped examples through ``meshyard run``: each one either
fails validation (exit code 2, a message, no traceback) or trains.

Mutations are drawn from the config schema itself: wrong types, strings for numbers,
negative, zero, huge and non-finite numbers, empty strings, unknown names, keys and
sections, both in the TOML file and as command-line overrides. Validation cases stop
where workers would start; a few cases that pass validation are then run for 2 steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import meshyard.api
from meshyard.cli import main
from meshyard.config.sections import SECTIONS
from meshyard.metrics.records import read_metrics
from meshyard.plugins import is_custom_reference

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))
SEED = 20240611
CASES = 40
RUN_CASES = 3

# Where a run keeps its files: the harness points these into the test's folder.
PATH_FIELDS = {("run", "dir"), ("run", "run_dir"), ("data", "cache_dir"), ("checkpoint", "dir")}


@dataclasses.dataclass(frozen=True)
class Case:
    example: str
    what: str  # one line: the mutation, for failure messages
    file_edits: tuple[tuple[tuple[str, ...], Any], ...] = ()  # (section, key) or (section,) -> value
    overrides: tuple[str, ...] = ()


def _fields() -> list[tuple[str, str, Any]]:
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += [(section, f.name, hints[f.name]) for f in dataclasses.fields(cls) if (section, f.name) not in PATH_FIELDS]
    return out


def _bad_values(tp: Any) -> list[Any]:
    """Values a user might write by mistake for a field of type ``tp``."""
    if typing.get_origin(tp) is typing.Literal:
        first = typing.get_args(tp)[0]
        return ["", "bogus", str(first).upper(), 3, [first]]
    common = ["", [1], {"a": 1}]
    return {
        int: [-1, 0, -(2 ** 40), 2 ** 40, "8", 1.5, True, *common],
        float: [-1.0, 0.0, math.nan, math.inf, -math.inf, 1e300, "0.5", False, *common],
        bool: ["yes", 1, 0, *common],
        str: ["", " ", 7, "no-such-thing", "x" * 300, "a:b", [""]],
        list: [[], "text", 3, [-1], ["a", 2], [[1]]],
        dict: ["x", 3, [1], {"a": {"b": math.nan}}],
    }[tp]


def _inline(value: Any) -> str:
    """``value`` in TOML's inline syntax."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _override(section: str, key: str, value: Any) -> str:
    """``value`` as a command line carries it: a bare word for strings, else TOML."""
    return f"--{section}.{key}={value if isinstance(value, str) else _inline(value)}"


def make_cases(seed: int = SEED, count: int = CASES) -> list[Case]:
    rng = random.Random(seed)
    fields = _fields()
    cases = []
    for index in range(count):
        example = rng.choice(EXAMPLES).name
        kind = index % 8
        section, key, tp = rng.choice(fields)
        value = rng.choice(_bad_values(tp))
        if kind in (0, 1, 2):
            cases.append(Case(example, f"file {section}.{key} = {value!r}", (((section, key), value),)))
        elif kind in (3, 4):
            cases.append(Case(example, f"override {section}.{key} = {value!r}", overrides=(_override(section, key, value),)))
        elif kind == 5:
            name = rng.choice(["stepz", "lr_rate", "nprocs", "", "strategy_"])
            cases.append(Case(example, f"unknown key {section}.{name}", (((section, name), 1),)))
        elif kind == 6:
            bad = rng.choice([(("paralel",), {"tp": 2}), (("model",), 3), (("train",), "fast"), (("",), {})])
            cases.append(Case(example, f"bad table {bad}", (bad,)))
        else:
            overrides = rng.choice([("--nproc", "-3"), ("--nproc=abc",), ("--train.steps",), ("--train=3",),
                                    ("--train.=1",), ("--parallel.tp=99999",), ("--parallel.pp=1000000",),
                                    ("--run.nproc=65536",), ("--resume=/no/such/run",), ("stray",)])
            cases.append(Case(example, f"command line {' '.join(overrides)}", overrides=overrides))
    return cases


def write_config(case: Case, folder: Path) -> Path:
    """The case's example made tiny (as tests/test_examples.py does), then mutated."""
    table = tomllib.loads((REPO / "examples" / case.example).read_text())
    for section, key in (("model", "name"), ("data", "source")):  # plugin files by absolute path
        value = table.get(section, {}).get(key, "")
        if is_custom_reference(value) and value.split(":")[0].endswith(".py"):
            table[section][key] = str(REPO / value)
    tiny = {"train": {"steps": 2}, "data": {"seq_len": 32, "cache_dir": str(folder / "cache")},
            "metrics": {"progress_bar": False}, "run": {"run_dir": str(folder / "run")}}
    if not is_custom_reference(table.get("data", {}).get("source", "")):
        tiny["data"] |= {"source": "random", "random_tokens": 65536}
    if not is_custom_reference(table.get("model", {}).get("name", "")):
        tiny["model"] = {"d_model": 48}
    for section, values in tiny.items():
        table.setdefault(section, {}).update(values)
    for where, value in case.file_edits:
        if len(where) == 1:
            table[where[0]] = value
        else:
            target = table.setdefault(where[0], {})
            if isinstance(target, dict):
                target[where[1]] = value
    path = folder / "config.toml"
    path.write_text(tomli_w.dumps(table))
    return path


def call_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def stop_at_launch(monkeypatch) -> list[int]:
    """Let ``meshyard run`` do everything up to starting workers; record the world sizes."""
    started: list[int] = []
    monkeypatch.setattr(meshyard.api, "launch_local", lambda fn, args, nproc, *rest: started.append(nproc) or [None])
    monkeypatch.setattr(meshyard.api, "run_worker", lambda *args: started.append(1))
    return started


def check_outcome(case: Case, code: int, err: str) -> None:
    assert "Traceback" not in err, f"{case.what}:\n{err}"
    assert code in (0, 2), f"{case.what}: exit {code}\n{err}"
    if code == 2:
        assert err.startswith("meshyard: ") or err.startswith("usage: "), f"{case.what}:\n{err}"


def validate_case(case: Case, folder: Path, monkeypatch, capsys) -> tuple[int, list[int]]:
    monkeypatch.chdir(folder)  # relative run directories and plugin paths land here
    started = stop_at_launch(monkeypatch)
    code, err = call_cli(["run", str(write_config(case, folder)), *case.overrides], capsys)
    check_outcome(case, code, err)
    return code, started


CASE_LIST = make_cases()


@pytest.mark.parametrize("case", CASE_LIST, ids=[f"{i}" for i in range(len(CASE_LIST))])
def test_mutation_fails_cleanly_or_validates(case, tmp_path, monkeypatch, capsys):
    validate_case(case, tmp_path, monkeypatch, capsys)


def test_mutations_that_validate_train(tmp_path, monkeypatch, capsys):
    """The first few valid mutations on at most 2 ranks really run their 2 steps."""
    chosen = []
    for index, case in enumerate(CASE_LIST):
        folder = tmp_path / f"validate{index}"
        folder.mkdir()
        with monkeypatch.context() as patch:
            code, started = validate_case(case, folder, patch, capsys)
        if code == 0 and started and started[0] <= 2:
            chosen.append(case)
        if len(chosen) == RUN_CASES:
            break
    assert len(chosen) == RUN_CASES
    for index, case in enumerate(chosen):
        folder = tmp_path / f"run{index}"
        folder.mkdir()
        monkeypatch.chdir(folder)
        code, err = call_cli(["run", str(write_config(case, folder)), *case.overrides], capsys)
        assert code == 0 and "Traceback" not in err, f"{case.what}: exit {code}\n{err[-3000:]}"
        assert [r["step"] for r in read_metrics(folder / "run")] == [1, 2], case.what
