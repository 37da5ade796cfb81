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
import logging
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
    runnable: bool = False  # safe to train if it validates: no huge sizes, the 2 steps kept


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


def _plausible(tp: Any) -> list[Any]:
    """Values of the right type that a field may well hold (choices of a Literal, and such)."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return {int: [1, 2, 4], float: [0.5, 1.0], bool: [True, False], str: ["text", "tokens"],
            list: [["*.txt"], [1, 1]], dict: [{}]}[tp]


def _small(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(value) <= 1000
    if isinstance(value, (list, dict)):
        return all(_small(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


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
        runnable = _small(value) and (section, key) != ("train", "steps")
        if kind in (0, 1):
            cases.append(Case(example, f"file {section}.{key} = {value!r}", (((section, key), value),), runnable=runnable))
        elif kind == 2:  # two fields at once: some values matter only beside another (paths of a text source)
            section2, key2, tp2 = rng.choice(fields)
            value2 = rng.choice([*_bad_values(tp2), *_plausible(tp2)])
            cases.append(Case(example, f"file {section}.{key} = {value!r}, {section2}.{key2} = {value2!r}",
                              (((section, key), value), ((section2, key2), value2)),
                              runnable=runnable and _small(value2) and (section2, key2) != ("train", "steps")))
        elif kind in (3, 4):
            cases.append(Case(example, f"override {section}.{key} = {value!r}",
                              overrides=(_override(section, key, value),), runnable=runnable))
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


def _library_logs_to_this_tests_stderr() -> None:
    """Libraries (transformers) bind their log handlers to the ``sys.stderr`` of the test that
    first imported them; in a later test that stream is a closed capture file, and a warning
    becomes a 'Logging error' traceback. Point such handlers at this test's stderr."""
    loggers = [logging.getLogger(), *(v for v in logging.root.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in (h for logger in loggers for h in logger.handlers):
        pinned_flush = getattr(vars(handler).get("flush"), "__self__", None)
        if isinstance(handler, logging.StreamHandler) and any(getattr(stream, "closed", False)
                                                              for stream in (handler.stream, pinned_flush)):
            handler.stream = sys.stderr  # not setStream(): it flushes the closed stream first
            vars(handler).pop("flush", None)  # transformers pins flush to its import-time stderr


def call_cli(argv: list[str], capsys) -> tuple[int, str]:
    _library_logs_to_this_tests_stderr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def stop_at_launch(monkeypatch) -> list[int]:
    """Let ``meshyard run`` do everything up to starting workers; record the world sizes."""
    started: list[int] = []
    monkeypatch.setattr(meshyard.api, "launch_local", lambda fn, args, nproc, *rest: started.append(nproc) or {0: None})
    monkeypatch.setattr(meshyard.api, "run_worker", lambda *args, **kwargs: started.append(1))
    return started


def check_outcome(case: Case, code: int, err: str) -> None:
    assert "Traceback" not in err, f"{case.what}:\n{err}"
    assert code in (0, 2), f"{case.what}: exit {code}\n{err}"
    if code == 2:
        # A library's own warning (a model builder's) may come first; meshyard's paragraph follows.
        assert err.startswith("usage: ") or any(line.startswith("meshyard: ") for line in err.splitlines()), \
            f"{case.what}:\n{err}"


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


# Mutations that once passed validation and then failed in the launcher or in every
# worker, with what validation now says about them.
REGRESSIONS = [
    (Case("default.toml", "fault.grace_period_s = inf: the launcher's int() raised OverflowError",
          ((("fault", "grace_period_s"), math.inf),)), "fault.grace_period_s = inf should be a finite number"),
    (Case("default.toml", "optim.eps = -1: AdamW refused it in the workers", overrides=("--optim.eps=-1.0",)),
     "optim.eps = -1.0 must be positive"),
    (Case("default.toml", "optim.eps = nan: the loss turned NaN", overrides=("--optim.eps=nan",)),
     "optim.eps = nan should be a finite number"),
    (Case("default.toml", "sgd with momentum -0.5: SGD refused it in the workers",
          overrides=("--optim.name=sgd", "--optim.momentum=-0.5")), "optim.momentum = -0.5 must not be negative"),
    (Case("default.toml", "train.seed = -5: NumPy refused it in the workers", overrides=("--train.seed=-5",)),
     "train.seed = -5 must not be negative"),
    (Case("default.toml", "parallel.bucket_mb = 1e300: DDP's byte count overflowed",
          overrides=("--parallel.bucket_mb=1e300",)), "parallel.bucket_mb = 1e+300 must be positive and at most"),
    (Case("default.toml", "model.vocab_size = 8 under 256 token ids: index out of range in the embedding",
          overrides=("--model.vocab_size=8",)), "model.vocab_size = 8 is smaller than the 256 token ids"),
    (Case("custom_model.toml", "model.options the builder does not take: TypeError in the workers",
          overrides=("--model.options={a = 1}",)), "takes no keyword argument 'a'"),
    (Case("default.toml", "data.paths = [2] for text: glob raised TypeError in the launching process",
          overrides=("--data.source=text", "--data.paths=[2]")), "data.paths = [2] must list files"),
    (Case("default.toml", "data.random_tokens = 2^40: MemoryError in the launching process",
          overrides=("--data.random_tokens=1099511627776",)), "data.random_tokens = 1099511627776 must be at most"),
    (Case("default.toml", "data.random_tokens = 100: fewer samples than a global batch, a ValueError in the workers",
          overrides=("--data.random_tokens=100",)), "has 2 samples of 32 tokens, fewer than one train.global_batch of 32"),
    (Case("default.toml", "model.n_head = 3 beside the preset's width 128: ValueError building the model",
          overrides=("--model.d_model=0", "--model.n_head=3")),
     "model.d_model = 128 (from 'gpt-mini') is not divisible by model.n_head = 3"),
    (Case("tp_pp.toml", "3 heads over tp = 2: ValueError in every worker", overrides=("--model.n_head=3",)),
     "model.n_head = 3 is not divisible by parallel.tp = 2"),
    (Case("tp_pp.toml", "1 block for 2 pipeline stages: PipelineSplitError in every worker",
          overrides=("--model.n_layer=1",)), "model.n_layer = 1 blocks are fewer than the 2 pipeline stages"),
    (Case("tp_pp.toml", "pp_split of 2 blocks for a model of 4: PipelineSplitError in every worker",
          overrides=("--parallel.pp_split=[1, 1]",)), "parallel.pp_split = [1, 1] sums to 2 blocks, not the 4"),
    (Case("default.toml", "fault.collective_timeout_s = 1e300: the timedelta overflowed in the workers",
          overrides=("--fault.collective_timeout_s=1e300",)), "fault.collective_timeout_s = 1e+300 must be positive"),
    (Case("default.toml", "run.threads_per_rank = 2^40: torch.set_num_threads overflowed in the workers",
          overrides=("--run.threads_per_rank=1099511627776",)), "run.threads_per_rank = 1099511627776 must be in"),
]


@pytest.mark.parametrize("case, message", REGRESSIONS, ids=[c.what.split(":")[0] for c, _ in REGRESSIONS])
def test_found_mutations_fail_validation(case, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    started = stop_at_launch(monkeypatch)
    code, err = call_cli(["run", str(write_config(case, tmp_path)), *case.overrides], capsys)
    assert code == 2 and not started, f"{case.what}: exit {code}\n{err}"
    assert message in err and "Traceback" not in err, err


def test_mutations_that_validate_train(tmp_path, monkeypatch, capsys):
    """The first few valid mutations on at most 2 ranks really run their 2 steps (drawn
    past CASE_LIST when needed: which draws are valid shifts whenever the schema grows)."""
    chosen = []
    for index, case in enumerate(make_cases(count=10 * CASES)):
        folder = tmp_path / f"validate{index}"
        folder.mkdir()
        with monkeypatch.context() as patch:
            code, started = validate_case(case, folder, patch, capsys)
        if code == 0 and case.runnable and started and started[0] <= 2:
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
