"""Every data-parallel layout trains the same model as one process with the same global batch.

The standard of correctness: per-step losses within 1e-5 relative (fp32) of a single
process, and gradient accumulation of k micro-steps equal to one k-times larger batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import meshyard
from meshyard.config.sections import Config
from tests.inprocess import fit_here, fit_on_ranks

STEPS = 5
REL_TOL = 1e-5
# Real text (so the loss falls within a few steps), read from the shared corpus cache.
DATA = ("--data.source=stdlib", "--data.max_tokens=400000", "--data.cache_dir=")


def losses_of(records: list[dict]) -> list[tuple[float, float]]:
    """Per-step (loss, global gradient norm) of a run's records."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in records]


def losses(config: Config, nproc: int) -> list[tuple[float, float]]:
    """Per-step (loss, global gradient norm) of a run launched as a user launches it."""
    return losses_of(meshyard.run(config, nproc=nproc).metrics())


def assert_close(actual: list[tuple[float, float]], expected: list[tuple[float, float]]) -> None:
    """Losses within REL_TOL; gradient norms (clipping is on) within 1e-4 relative, which
    fails if a sharded layout clipped by the norm of its own shard."""
    assert len(actual) == len(expected)
    for step, ((a, a_norm), (e, e_norm)) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= REL_TOL * abs(e), f"step {step}: {a} vs {e} (rel {abs(a - e) / abs(e):.2e})"
        assert abs(a_norm - e_norm) <= 1e-4 * e_norm, f"step {step}: grad norm {a_norm} vs {e_norm}"


TWO_RANKS = {
    "ddp": ["--parallel.strategy=ddp"],
    "fsdp-zero3": ["--parallel.strategy=fsdp"],
    "fsdp-zero2": ["--parallel.strategy=fsdp", "--parallel.reshard_after_forward=false"],
    "zero1": ["--parallel.strategy=zero1"],
    "ddp-accumulation": ["--parallel.strategy=ddp", "--train.micro_batch=2"],
}


def _config(folder: Path, *overrides: str) -> Config:
    from tests.conftest import tiny_config

    return tiny_config(folder, *DATA, f"--train.steps={STEPS}", *overrides)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list[tuple[float, float]]:
    """One process, launched as a user launches it (the layouts below are built in-process)."""
    values = losses(_config(tmp_path_factory.mktemp("baseline"), "--parallel.strategy=none"), nproc=1)
    assert values[-1][0] < values[0][0], "the baseline itself must learn"
    assert values[0][1] > 1.0, "clipping (train.grad_clip = 1) must be active for the norm check to bite"
    return values


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory) -> dict[str, list[tuple[float, float]]]:
    """Every two-rank layout, trained one after another in one spawn of two ranks."""
    root = tmp_path_factory.mktemp("two-ranks")
    configs = [_config(root / name, *overrides) for name, overrides in TWO_RANKS.items()]
    return {name: losses_of(records) for name, records in zip(TWO_RANKS, fit_on_ranks(configs, 2))}


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_ranks_match_single_process(two_rank_losses, baseline, layout):
    assert_close(two_rank_losses[layout], baseline)


def test_hsdp_on_four_ranks_matches_single_process(tmp_path, baseline):
    cfg = _config(tmp_path, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2")
    assert_close(losses_of(fit_on_ranks([cfg], 4)[0]), baseline)


def test_accumulation_equals_larger_batch(tmp_path, baseline):
    cfg = _config(tmp_path, "--parallel.strategy=none", "--train.grad_accum=4")
    assert_close(losses_of(fit_here(cfg)), baseline)
