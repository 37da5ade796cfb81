"""Every data-parallel layout trains the same model as one process with the same global batch.

The standard of correctness: per-step losses within 1e-5 relative (fp32) of a single
process, and gradient accumulation of k micro-steps equal to one k-times larger batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import meshyard
from meshyard.config.sections import Config
from meshyard.metrics.records import read_metrics
from meshyard.validate import validate
from tests import shared_spawn
from tests.inprocess import fit_each_with_facts, fit_here

STEPS = 5
REL_TOL = 1e-5
# Real text (so the loss falls within a few steps), read from the shared corpus cache.
DATA = ("--data.source=stdlib", "--data.max_tokens=400000", "--data.cache_dir=")


def losses_of(records: list[dict]) -> list[tuple[float, float]]:
    """Per-step (loss, global gradient norm) of a run's records."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in records]


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
    # The head and the loss fused (train.fused_linear_loss): the root's gathered head weight.
    "fsdp-zero3-fused-loss": ["--parallel.strategy=fsdp", "--train.fused_linear_loss=true"],
    "ddp-fused-loss": ["--parallel.strategy=ddp", "--train.fused_linear_loss=true"],
}


def _config(folder: Path, *overrides: str) -> Config:
    from tests.conftest import tiny_config

    return tiny_config(folder, *DATA, f"--train.steps={STEPS}", *overrides)


SingleProcessRun = tuple[list[tuple[float, float]], dict]
SINGLE_PROCESS = pytest.StashKey[SingleProcessRun]()


def single_process_run(request: pytest.FixtureRequest) -> SingleProcessRun:
    """Per-step (loss, grad norm) and run.json facts of the one-process run launched as a
    user launches it (in this process); tests/parallel/test_meta_init.py holds its layouts
    to the same run, so it is trained once per test session (kept in the session's stash)."""
    stash = request.config.stash
    if SINGLE_PROCESS not in stash:
        folder = request.getfixturevalue("tmp_path_factory").mktemp("single-process")
        result = meshyard.run(_config(folder, "--parallel.strategy=none"), nproc=1)
        stash[SINGLE_PROCESS] = (losses_of(result.metrics()), json.loads((result.run_dir / "run.json").read_text()))
    return stash[SINGLE_PROCESS]


@pytest.fixture(scope="module")
def baseline(request) -> list[tuple[float, float]]:
    """One process, launched as a user launches it (the layouts below are built in-process)."""
    values, _ = single_process_run(request)
    assert values[-1][0] < values[0][0], "the baseline itself must learn"
    assert values[0][1] > 1.0, "clipping (train.grad_clip = 1) must be active for the norm check to bite"
    return values


HSDP = ("--parallel.strategy=fsdp", "--parallel.dp_replicate=2")


def _fitted_job(world_size: int, *layouts: tuple[str, ...]) -> shared_spawn.JobMaker:
    """A job for the shared spawn: a config of each layout fitted in turn, each under the
    job's folder in a folder named by its position."""
    def make(request: pytest.FixtureRequest, folder: Path) -> tuple:
        configs = [_config(folder / str(index), *overrides) for index, overrides in enumerate(layouts)]
        for cfg in configs:
            validate(cfg, world_size)
        return fit_each_with_facts, (configs,)
    return make


def _fitted_losses(request: pytest.FixtureRequest, world_size: int, name: str,
                   count: int) -> list[list[tuple[float, float]]]:
    """Per layout of job ``name`` (``count`` of them), its per-step (loss, grad norm)."""
    folder, _ = shared_spawn.result(request, world_size, name)
    return [losses_of(read_metrics(folder / str(index) / "run")) for index in range(count)]


# SGD over DTensors: PyTorch has no DTensor rule for the fused SGD kernel, so the step loops.
SGD = ("--optim.name=sgd", "--optim.momentum=0.9")
TWO_RANKS_SGD = ("--parallel.strategy=fsdp", *SGD)

shared_spawn.register(2, "parity: layouts", __name__, _fitted_job(2, *TWO_RANKS.values(), TWO_RANKS_SGD))
shared_spawn.register(4, "parity: hsdp", __name__, _fitted_job(4, HSDP))


@pytest.fixture(scope="module")
def two_rank_losses(request) -> dict[str, list[tuple[float, float]]]:
    """Every two-rank layout, trained one after another in the session's one spawn of two ranks."""
    return dict(zip(TWO_RANKS, _fitted_losses(request, 2, "parity: layouts", len(TWO_RANKS))))


def test_sgd_over_fsdp_shards_matches_single_process(request, tmp_path):
    """Trained in the session's one spawn of two ranks, after the layouts above."""
    losses = _fitted_losses(request, 2, "parity: layouts", len(TWO_RANKS) + 1)[-1]
    assert_close(losses, losses_of(fit_here(_config(tmp_path, "--parallel.strategy=none", *SGD))))


@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_ranks_match_single_process(two_rank_losses, baseline, layout):
    assert_close(two_rank_losses[layout], baseline)


def test_the_baseline_steps_its_optimizer_fused_on_cpu(request):
    """run.json records the step that ran: fused, also on CPU (train.optim.step_implementation)."""
    _, facts = single_process_run(request)
    assert facts["optimizer_step"] == "fused"


def test_hsdp_on_four_ranks_matches_single_process(request, baseline):
    """Trained in the session's one spawn of four ranks."""
    [losses] = _fitted_losses(request, 4, "parity: hsdp", 1)
    assert_close(losses, baseline)


def test_accumulation_equals_larger_batch(tmp_path, baseline):
    cfg = _config(tmp_path, "--parallel.strategy=none", "--train.grad_accum=4")
    assert_close(losses_of(fit_here(cfg)), baseline)


def test_the_fused_head_and_loss_train_as_the_logits_do(tmp_path, baseline):
    """train.fused_linear_loss under accumulation: each micro-batch's mean, its gradients
    computed in the forward and scaled in the backward."""
    cfg = _config(tmp_path, "--parallel.strategy=none", "--train.grad_accum=2", "--train.fused_linear_loss=true")
    assert_close(losses_of(fit_here(cfg)), baseline)
