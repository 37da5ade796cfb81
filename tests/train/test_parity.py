"""Every data-parallel layout trains the same model as one process with the same global batch.

The standard of correctness: per-step losses within 1e-5 relative (fp32) of a single
process, and gradient accumulation of k micro-steps equal to one k-times larger batch.
"""

from __future__ import annotations

import pytest

import meshyard
from meshyard.config.sections import Config

STEPS = 5
REL_TOL = 1e-5
# Real text (so the loss falls within a few steps), read from the shared corpus cache.
DATA = ("--data.source=stdlib", "--data.max_tokens=400000", "--data.cache_dir=")


def losses(config: Config, nproc: int) -> list[tuple[float, float]]:
    """Per-step (loss, global gradient norm) of a run."""
    result = meshyard.run(config, nproc=nproc)
    records = result.metrics()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in records]


def assert_close(actual: list[tuple[float, float]], expected: list[tuple[float, float]]) -> None:
    """Losses within REL_TOL; gradient norms (clipping is on) within 1e-4 relative, which
    fails if a sharded layout clipped by the norm of its own shard."""
    assert len(actual) == len(expected)
    for step, ((a, a_norm), (e, e_norm)) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= REL_TOL * abs(e), f"step {step}: {a} vs {e} (rel {abs(a - e) / abs(e):.2e})"
        assert abs(a_norm - e_norm) <= 1e-4 * e_norm, f"step {step}: grad norm {a_norm} vs {e_norm}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list[float]:
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path_factory.mktemp("baseline"), *DATA, f"--train.steps={STEPS}",
                      "--parallel.strategy=none")
    values = losses(cfg, nproc=1)
    assert values[-1][0] < values[0][0], "the baseline itself must learn"
    assert values[0][1] > 1.0, "clipping (train.grad_clip = 1) must be active for the norm check to bite"
    return values


@pytest.mark.parametrize(
    "strategy_args",
    [
        ["--parallel.strategy=ddp"],
        ["--parallel.strategy=fsdp"],
        ["--parallel.strategy=fsdp", "--parallel.reshard_after_forward=false"],
        ["--parallel.strategy=zero1"],
    ],
    ids=["ddp", "fsdp-zero3", "fsdp-zero2", "zero1"],
)
def test_two_ranks_match_single_process(make_config, baseline, strategy_args):
    cfg = make_config(*DATA, f"--train.steps={STEPS}", *strategy_args)
    assert_close(losses(cfg, nproc=2), baseline)


def test_hsdp_on_four_ranks_matches_single_process(make_config, baseline):
    cfg = make_config(*DATA, f"--train.steps={STEPS}", "--parallel.strategy=fsdp", "--parallel.dp_replicate=2")
    result_losses = losses(cfg, nproc=4)
    assert_close(result_losses, baseline)


def test_accumulation_equals_larger_batch(make_config, baseline):
    cfg = make_config(*DATA, f"--train.steps={STEPS}", "--parallel.strategy=none", "--train.grad_accum=4")
    assert_close(losses(cfg, nproc=1), baseline)


def test_accumulation_under_ddp_matches(make_config, baseline):
    cfg = make_config(*DATA, f"--train.steps={STEPS}", "--parallel.strategy=ddp", "--train.micro_batch=2")
    assert_close(losses(cfg, nproc=2), baseline)
