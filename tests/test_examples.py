"""Every shipped example config is valid for the world size it asks for, and runs there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshyard.cli import main
from meshyard.config.load import load_config
from meshyard.metrics.records import read_metrics
from meshyard.plugins import is_custom_reference, load_callable
from meshyard.validate import load_and_validate

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_valid(path, monkeypatch):
    monkeypatch.chdir(path.parents[1])  # plugin paths are relative to the repository
    config, layout = load_and_validate(path, [])
    assert layout.dims.world_size == config.run.nproc
    for reference in (config.model.name, config.data.source):
        if is_custom_reference(reference):
            assert callable(load_callable(reference))


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


def tiny_overrides(path: Path, tmp_path: Path) -> list[str]:
    """Shrink an example to seconds: 2 steps on short random samples (a plugin dataset is
    kept), a narrower model, records under tmp_path. Layout and batch arithmetic stay."""
    overrides = ["--train.steps=2", "--data.seq_len=32", "--metrics.progress_bar=false",
                 f"--run.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    config = load_config(path)
    if not is_custom_reference(config.data.source):
        overrides += ["--data.source=random", "--data.random_tokens=65536"]
    if not is_custom_reference(config.model.name):
        overrides.append("--model.d_model=48")  # divisible by every preset's heads (2, 4, 6, 8, 12)
    return overrides


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path, monkeypatch, capsys):
    """``meshyard run <example>`` trains with the example's own layout and world size."""
    monkeypatch.chdir(path.parents[1])
    assert main(["run", str(path), *tiny_overrides(path, tmp_path)]) == 0, capsys.readouterr().err[-3000:]
    config = load_config(path)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    facts = json.loads((tmp_path / "run" / "run.json").read_text())
    assert facts["world_size"] == config.run.nproc and facts["strategy"] == config.parallel.strategy
    assert (facts["tp"], facts["pp"]) == (config.parallel.tp, config.parallel.pp)
    assert facts["activation_checkpointing"] == config.parallel.ac
    if config.parallel.dp_replicate:
        assert facts["dp_replicate"] == config.parallel.dp_replicate
