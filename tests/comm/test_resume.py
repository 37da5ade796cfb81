"""Compression state (error-feedback residuals, PowerSGD matrices) is in the checkpoint,
so a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

import pytest

from meshyard.checkpoint.tools import read_full_state, resolve
from tests.conftest import tiny_config
from tests.inprocess import fit_in_order

STEPS, HALF = 8, 4
METHODS = ["topk", "powersgd"]


def job(tmp_path, method: str, part: str, steps: int):
    return tiny_config(tmp_path / f"{method}-{part}", f"--comm.compression={method}", "--comm.warmup_steps=2",
                       "--comm.topk_ratio=0.05", "--optim.schedule=constant", "--train.deterministic=true",
                       "--checkpoint.enabled=true", "--checkpoint.interval=0", "--checkpoint.async_save=false",
                       f"--train.steps={steps}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per method: the uninterrupted run's records, the first half's run directory and the
    records of the second half resumed from it; every run on 2 ranks in one spawn (what is
    under test is the state a rank saves and loads, not how ranks are launched)."""
    tmp = tmp_path_factory.mktemp("compression")
    jobs, first_halves = [], {}
    for method in METHODS:
        first = job(tmp, method, "first", HALF)
        first_halves[method] = first.run.run_dir
        jobs += [(job(tmp, method, "whole", STEPS), "none"), (first, "none"),
                 (job(tmp, method, "second", STEPS), str(first.run.run_dir))]
    records = fit_in_order(jobs, world_size=2)
    return {method: (records[3 * i], first_halves[method], records[3 * i + 2]) for i, method in enumerate(METHODS)}


@pytest.mark.parametrize("method", METHODS)
def test_resume_with_compression_state_is_exact(runs, method):
    whole, first_run_dir, resumed = runs[method]
    assert [r["step"] for r in resumed] == list(range(HALF + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[HALF:]]
    assert all(r["compression_ratio"] > 1 for r in resumed)
    keys = read_full_state(resolve(str(first_run_dir), {})).keys()
    assert {"comm.rank0", "comm.rank1"} <= set(keys)
