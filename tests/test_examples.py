"""Every shipped example config is valid for the world size it asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshyard.config.validate import load_and_validate
from meshyard.plugins import is_custom_reference, load_callable

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
